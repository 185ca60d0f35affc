"""The latency model of one inference instance: how long prefill, a decode step and a KV-block
transfer take on a given number of cards, and how many bytes of KV cache a token holds.

Called by :mod:`matrixpool.serving.engine` (every simulated iteration) and by the estimator
(per-replica capacity). Pure arithmetic; every constant below names its source or says that it
is an assumption.

The model, per instance of ``cards`` cards:

1. Prefill is compute-bound and linear in the tokens computed:
   ``tokens / (PREFILL_TOKENS_PER_S_PER_CARD * cards)``.
2. A decode step produces one token for every sequence of the batch and takes
   ``base + (batch * (1 - share) + context / REFERENCE_CONTEXT_TOKENS * share) * per_sequence
   / cards``: a fixed part (weights read, expert dispatch and combine) and a part per sequence
   of which ``share`` (attention over the KV cache) grows with the sequence's context. The base
   and the per-sequence cost are fitted to the paper's two published decode points (below), so
   at the operating batch (96 sequences per card, 4K context) a card yields ~1,943 tokens/s at
   a TPOT just under 50 ms, and TPOT grows with the batch and with the context.
3. A cached KV block moves from host memory to the cards at the local or the remote (another
   node of the supernode) bandwidth, after a fixed setup time.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

# --- published figures ------------------------------------------------------------------------
# CloudMatrix-Infer serving DeepSeek-R1 (INT8) on a CloudMatrix384 supernode: Zuo et al.,
# "Serving Large Language Models on Huawei CloudMatrix384", arXiv 2506.12708 (abstract).
PREFILL_TOKENS_PER_S_PER_CARD = 6_688.0  # prefill throughput per NPU (one card = one NPU here)
DECODE_TOKENS_PER_S_PER_CARD = 1_943.0  # decode throughput per NPU at a TPOT under 50 ms
TPOT_LIMIT_S = 0.050  # the latency bound of that figure
LOW_LATENCY_TOKENS_PER_S_PER_CARD = 538.0  # decode throughput per NPU under a 15 ms TPOT
LOW_LATENCY_TPOT_S = 0.015  # the bound of that figure
# The decode batch per NPU behind the 1,943 tokens/s, and the KV length of the paper's decode
# runs, as read from the paper's decode evaluation (re-check against its decode table if the
# exact setting matters; the throughput and TPOT fits below hold for any batch whose TPOT
# stays under 50 ms).
OPERATING_BATCH_PER_CARD = 96
REFERENCE_CONTEXT_TOKENS = 4_096
# Derived: the TPOT at that batch (96 / 1,943 = 49.4 ms) and the batch under 15 ms
# (538 tokens/s x 15 ms = 8.07 sequences per card).
OPERATING_TPOT_S = OPERATING_BATCH_PER_CARD / DECODE_TOKENS_PER_S_PER_CARD
LOW_LATENCY_BATCH_PER_CARD = LOW_LATENCY_TOKENS_PER_S_PER_CARD * LOW_LATENCY_TPOT_S
# The straight line through both points: 0.391 ms per sequence per card on a 11.8 ms base.
DECODE_PER_SEQUENCE_S = (OPERATING_TPOT_S - LOW_LATENCY_TPOT_S) / (
    OPERATING_BATCH_PER_CARD - LOW_LATENCY_BATCH_PER_CARD
)
DECODE_BASE_S = OPERATING_TPOT_S - OPERATING_BATCH_PER_CARD * DECODE_PER_SEQUENCE_S
# Assumption: a quarter of a sequence's step cost is attention over its KV cache (and scales
# with its context); the rest (MoE experts, projections) does not. The paper gives no split.
ATTENTION_SHARE = 0.25

# --- KV cache ---------------------------------------------------------------------------------
# DeepSeek-V3/R1 with multi-head latent attention caches, per token and layer, the compressed
# latent (kv_lora_rank 512) and the decoupled RoPE key (qk_rope_head_dim 64): 576 values, over
# num_hidden_layers 61 (the model's config.json). One byte per value assumes an INT8 cache, as
# the paper's INT8 serving path; BF16 would double it. 61 x 576 x 1 = 35,136 bytes (~34.3 KiB).
MLA_LAYERS = 61
MLA_VALUES_PER_TOKEN_LAYER = 512 + 64
KV_BYTES_PER_VALUE = 1
KV_BYTES_PER_TOKEN = MLA_LAYERS * MLA_VALUES_PER_TOKEN_LAYER * KV_BYTES_PER_VALUE
# Ascend 910C: 128 GB of HBM per card (paper, hardware section). Assumption: a quarter of it
# holds KV cache, the rest weights, activations and communication buffers.
HBM_BYTES_PER_CARD = 128 * 10**9
KV_BUDGET_BYTES_PER_CARD = HBM_BYTES_PER_CARD // 4

# --- KV block transfer ------------------------------------------------------------------------
# CloudMatrix384's Unified Bus gives each 910C 392 GB/s one way and each Kunpeng CPU about
# 160 GB/s (paper, hardware section). Cached blocks live in the CPUs' host memory (the memory
# pool), so a block read crosses one CPU's UB link, not the card's wider one: 160 GB/s from
# the card's own node.
LOCAL_BYTES_PER_S = 160e9
# Assumption: from another node the block also crosses the second-tier UB switches and shares
# them with expert-parallel traffic; taken as 75% of the local rate.
REMOTE_BYTES_PER_S = 0.75 * LOCAL_BYTES_PER_S
# Assumption: a fixed cost per transfer (pool lookup and DMA setup): 10 us local, 30 us remote.
LOCAL_SETUP_S = 10e-6
REMOTE_SETUP_S = 30e-6


@dataclass(frozen=True)
class LatencyModel:
    """The constants above as one value; :meth:`scaled` makes a faster one for tests and demos."""

    prefill_tokens_per_s_per_card: float = PREFILL_TOKENS_PER_S_PER_CARD  # prefill rate
    decode_base_s: float = DECODE_BASE_S  # fixed part of a decode step
    decode_per_sequence_s: float = DECODE_PER_SEQUENCE_S  # per sequence and card, at reference
    attention_share: float = ATTENTION_SHARE  # part of that which grows with the context
    reference_context_tokens: int = REFERENCE_CONTEXT_TOKENS  # context of the fit
    operating_batch_per_card: int = OPERATING_BATCH_PER_CARD  # decode batch at the 50 ms point
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN  # KV cache one token holds
    kv_budget_bytes_per_card: int = KV_BUDGET_BYTES_PER_CARD  # HBM left to the KV cache
    local_bytes_per_s: float = LOCAL_BYTES_PER_S  # host memory of the card's own node
    remote_bytes_per_s: float = REMOTE_BYTES_PER_S  # host memory of another node
    local_setup_s: float = LOCAL_SETUP_S  # fixed cost of a local transfer
    remote_setup_s: float = REMOTE_SETUP_S  # fixed cost of a remote transfer

    def prefill_seconds(self, tokens: int, cards: int) -> float:
        """Seconds to prefill ``tokens`` tokens (0 for none) on ``cards`` cards."""
        _check_cards(cards)
        return max(0, tokens) / (self.prefill_tokens_per_s_per_card * cards)

    def decode_step_seconds(self, batch: int, context_tokens: int, cards: int) -> float:
        """Seconds of one decode step of ``batch`` sequences attending over ``context_tokens``
        KV tokens in all (summed over the batch) on ``cards`` cards."""
        _check_cards(cards)
        if batch < 1:
            raise ValueError(f"a decode step needs a sequence, got batch {batch}")
        fixed = batch * (1 - self.attention_share)
        attention = context_tokens / self.reference_context_tokens * self.attention_share
        return self.decode_base_s + (fixed + attention) * self.decode_per_sequence_s / cards

    def decode_tokens_per_s(self, batch: int, context_tokens: int, cards: int) -> float:
        """Tokens per second of an instance decoding ``batch`` sequences (one token each step)."""
        return batch / self.decode_step_seconds(batch, context_tokens, cards)

    def operating_batch(self, cards: int) -> int:
        """The decode batch of an instance at the published operating point."""
        _check_cards(cards)
        return self.operating_batch_per_card * cards

    def kv_bytes(self, tokens: int) -> int:
        return max(0, tokens) * self.kv_bytes_per_token

    def kv_capacity_tokens(self, cards: int) -> int:
        """Tokens of KV cache an instance of ``cards`` cards holds."""
        _check_cards(cards)
        return self.kv_budget_bytes_per_card * cards // self.kv_bytes_per_token

    def transfer_seconds(self, nbytes: int, remote: bool) -> float:
        """Seconds to move ``nbytes`` of KV cache from host memory, local or remote, to a card;
        0 for nothing."""
        if nbytes <= 0:
            return 0.0
        if remote:
            return self.remote_setup_s + nbytes / self.remote_bytes_per_s
        return self.local_setup_s + nbytes / self.local_bytes_per_s

    def scaled(self, speed: float) -> LatencyModel:
        """The same model ``speed`` times faster: rates multiplied, times divided."""
        if not speed > 0 or math.isinf(speed):
            raise ValueError(f"speed must be a positive number, got {speed}")
        return dataclasses.replace(
            self,
            prefill_tokens_per_s_per_card=self.prefill_tokens_per_s_per_card * speed,
            decode_base_s=self.decode_base_s / speed,
            decode_per_sequence_s=self.decode_per_sequence_s / speed,
            local_bytes_per_s=self.local_bytes_per_s * speed,
            remote_bytes_per_s=self.remote_bytes_per_s * speed,
            local_setup_s=self.local_setup_s / speed,
            remote_setup_s=self.remote_setup_s / speed,
        )


def _check_cards(cards: int) -> None:
    if cards < 1:
        raise ValueError(f"an instance needs at least one card, got {cards}")


# The published model, and its methods as functions for callers that need no other.
DEFAULT = LatencyModel()
prefill_seconds = DEFAULT.prefill_seconds
decode_step_seconds = DEFAULT.decode_step_seconds
kv_bytes = DEFAULT.kv_bytes
transfer_seconds = DEFAULT.transfer_seconds
