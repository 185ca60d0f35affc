"""The real inference engine of the tests and the serving benchmark: llama.cpp's server.

``tools/engine/build.sh`` builds ``llama-server`` from source once, into
``~/.cache/matrixpool/engine/`` (:func:`server` runs it and passes its progress on);
:func:`write_model` writes a tiny Llama-architecture model for it with PyPI's ``gguf``: random
weights and a byte-level vocabulary, so nothing is downloaded. The vocabulary is the 128 ASCII
bytes (SentencePiece's byte fallback), not 256: every token the model can emit is then valid
UTF-8 on its own, so the server streams one chunk per token as it does for a real model (it
holds back a byte that only starts a character); prompts are ASCII text, or token ids from
:data:`FIRST_BYTE` on. The answers are noise; the engine's work per token — attention over its
context, the feed-forward layers, its batching, prompt cache and slot bookkeeping, its
``/metrics`` — is the real engine's.

A pod runs it as a user's pod would run any engine (``command: [llama-server, ...]``): under
the process kubelet the machine's ``llama-server`` is found on the image's PATH
(:func:`install`), in a real node's container the image carries it (``tools/image/build.sh``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from matrixpool.devcluster import binaries

SPECIALS = ("<unk>", "<s>", "</s>")
BYTES = 128  # byte tokens <0x00>..<0x7F>, after the specials
FIRST_BYTE = len(SPECIALS)  # the token id of <0x00>
VOCAB = FIRST_BYTE + BYTES


class EngineError(RuntimeError):
    """The engine could not be built or found."""


def server(progress: Callable[[str], None] = print) -> Path:
    """The ``llama-server`` binary, built first when the cache lacks it
    (``MATRIXPOOL_LLAMA_SERVER`` names a prebuilt one instead)."""
    override = os.environ.get("MATRIXPOOL_LLAMA_SERVER")
    if override:
        if not os.access(override, os.X_OK):
            raise EngineError(f"MATRIXPOOL_LLAMA_SERVER={override} is not an executable")
        return Path(override)
    script = binaries.repo_root() / "tools" / "engine" / "build.sh"
    if not script.exists():
        raise EngineError(f"{script} not found: set MATRIXPOOL_LLAMA_SERVER")
    try:
        return binaries.build(script, progress)
    except binaries.BuildError as error:
        raise EngineError(str(error)) from error


def install(binary: Path, folder: Path) -> Path:
    """``binary`` linked as ``folder/llama-server`` (a folder on the image's PATH: the
    virtualenv's bin), replacing an older link; returns the link."""
    link = folder / "llama-server"
    if link.is_symlink() or link.exists():
        if link.resolve() == binary.resolve():
            return link
        link.unlink()
    link.symlink_to(binary)
    return link


def write_model(
    path: Path,
    *,
    layers: int = 2,
    width: int = 128,
    heads: int = 4,
    feed_forward: int = 384,
    context: int = 4096,
    seed: int = 0,
) -> Path:
    """A Llama-architecture GGUF model of random float32 weights at ``path`` (written once
    per shape and seed: a file already there is kept)."""
    if path.exists():
        return path
    import gguf  # the tests' and the benchmark's dependency only
    import numpy as np

    rng = np.random.default_rng(seed)
    vocab = VOCAB
    tmp = path.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name("matrixpool-tiny")
    writer.add_context_length(context)
    writer.add_embedding_length(width)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(feed_forward)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_rope_dimension_count(width // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([*SPECIALS, *(f"<0x{b:02X}>" for b in range(BYTES))])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types(
        [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
        + [gguf.TokenType.BYTE] * BYTES
    )
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)

    def weights(*shape: int) -> np.ndarray[Any, Any]:
        drawn: np.ndarray[Any, Any] = rng.standard_normal(shape) / np.sqrt(shape[-1])
        return drawn.astype(np.float32)

    writer.add_tensor("token_embd.weight", weights(vocab, width))
    writer.add_tensor("output_norm.weight", np.ones(width, dtype=np.float32))
    writer.add_tensor("output.weight", weights(vocab, width))
    for i in range(layers):
        block = f"blk.{i}"
        writer.add_tensor(f"{block}.attn_norm.weight", np.ones(width, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{block}.{name}.weight", weights(width, width))
        writer.add_tensor(f"{block}.ffn_norm.weight", np.ones(width, dtype=np.float32))
        writer.add_tensor(f"{block}.ffn_gate.weight", weights(feed_forward, width))
        writer.add_tensor(f"{block}.ffn_up.weight", weights(feed_forward, width))
        writer.add_tensor(f"{block}.ffn_down.weight", weights(width, feed_forward))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(path)
    return path


def command(
    model: str,
    *,
    host: str = "$(POD_IP)",
    port: int = 8080,
    slots: int = 4,
    threads: int = 1,
    context: int = 4096,
    extra: Sequence[str] = (),
) -> list[str]:
    """The container command of an engine pod: ``model`` served on ``host:port`` with
    ``slots`` sequences batched, ``threads`` CPU threads, ``/metrics`` on, and each slot's
    share of ``context`` tokens."""
    return [
        "llama-server",
        *("--model", model, "--host", host, "--port", str(port)),
        *("--parallel", str(slots), "--threads", str(threads), "--threads-batch", str(threads)),
        *("--ctx-size", str(context), "--metrics", "--no-webui", "--log-disable"),
        *extra,
    ]
