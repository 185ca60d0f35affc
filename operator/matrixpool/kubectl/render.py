"""Drawing the plugin's reports: aligned tables, the card map as ANSI-coloured terminal text,
and the card map as a PNG image written with zlib and struct alone (no imaging library).

Called by :mod:`matrixpool.kubectl.cli` with the dataclasses of :mod:`matrixpool.kubectl.report`.
Every function returns text or bytes; only :func:`write_png` touches a file.

PNG layout: racks side by side, each rack a column of its nodes, each node a row of cards;
each card is a ``BLOCK`` × ``BLOCK`` square of its owner's colour, with a 1-pixel gap of
``BACKGROUND`` between cards and nodes and a ``BLOCK``-wide gap between racks. So the pixels of
an owner's colour number exactly cards-of-that-owner × ``BLOCK``².
"""

from __future__ import annotations

import struct
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from matrixpool.api import trainingjob
from matrixpool.kubectl import report
from matrixpool.kubectl.report import Owner

BLOCK = 8  # side of a card's square, pixels
GAP = 1  # pixels between cards and between nodes
RACK_GAP = BLOCK  # pixels between racks
BACKGROUND = (255, 255, 255)  # gaps; never an owner's colour

RGB: dict[Owner, tuple[int, int, int]] = {
    Owner.INFERENCE: (66, 133, 244),  # blue
    Owner.TRAINING: (52, 168, 83),  # green
    Owner.SPARE: (251, 188, 5),  # amber
    Owner.UNHEALTHY: (234, 67, 53),  # red
    Owner.FREE: (200, 200, 200),  # light grey
    Owner.DOWN: (64, 64, 64),  # dark grey
}
ANSI: dict[Owner, str] = {  # SGR foreground colours
    Owner.INFERENCE: "34",
    Owner.TRAINING: "32",
    Owner.SPARE: "33",
    Owner.UNHEALTHY: "31",
    Owner.FREE: "37",
    Owner.DOWN: "90",
}
LETTER: dict[Owner, str] = {  # one character per card without colour
    Owner.INFERENCE: "I",
    Owner.TRAINING: "T",
    Owner.SPARE: "S",
    Owner.UNHEALTHY: "X",
    Owner.FREE: ".",
    Owner.DOWN: "D",
}


# --- tables ---------------------------------------------------------------------------------
def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Columns padded to their widest cell, two spaces apart, like ``kubectl get``."""
    cells = [list(headers), *([_cell(v) for v in row] for row in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells)
    return "\n".join(line.rstrip() for line in lines)


def _cell(value: object) -> str:
    return "-" if value is None or value == "" else str(value)


def status_table(rows: Iterable[report.StatusRow]) -> str:
    headers = ("SUPERNODE", "INFERENCE", "TRAINING", "SPARE", "UNHEALTHY", "FREE", "NODES")
    return table(
        (*headers, "WINDOW", "NEXT-TRANSITION", "LAST-TRANSITION"),
        (
            (
                *(r.name, r.inference, r.training, r.spare, r.unhealthy, r.free),
                *(f"{r.nodes_ready}/{r.nodes_total}", r.window, r.next_transition),
                r.last_transition,
            )
            for r in rows
        ),
    )


def jobs_table(rows: Iterable[report.JobRow]) -> str:
    headers = ("NAMESPACE", "KIND", "NAME", "PHASE", "SUPERNODES", "CARDS")
    return table(
        (*headers, "DESIRED", "BOUND", "RUNNING", "AUTOSCALED", "KV"),
        (
            (
                *(r.namespace, r.kind, r.name, r.phase, r.supernodes, r.cards),
                *(r.desired, r.bound, r.running, r.autoscaled, r.kv),
            )
            for r in rows
        ),
    )


def recoveries_text(job: str, rows: Sequence[report.RecoveryRow]) -> str:
    """The timeline of a job's recoveries, or a line saying there were none."""
    if not rows:
        return f"{job}: no recoveries"
    headers = ("#", "ID", "LEVEL", "RESTORED-STEP", "LOST-STEPS", "RANKS", "MOVES")
    return table(
        (*headers, "DETECTED", "RECOVERED", "TOOK", "CAUSE"),
        (
            (
                *(i, r.id, r.level, r.restored_step, r.lost_steps, _ranks(r.ranks, r.rank_count)),
                ",".join(f"{a}->{b}" for a, b in r.moves),
                *(r.detected_at.isoformat(), _when(r), _took(r), r.cause),
            )
            for i, r in enumerate(rows, 1)
        ),
    )


def _ranks(ranks: Sequence[int], count: int | None = None) -> str:
    """Ranks as ranges: 0-3,7; "(+N)" when the record lists only the lowest of them."""
    listed = trainingjob.format_ranks(ranks)
    more = (count or 0) - len(set(ranks))
    return f"{listed} (+{more})" if more > 0 else listed


def _when(row: report.RecoveryRow) -> str:
    return row.recovered_at.isoformat() if row.recovered_at else "(recovering)"


def _took(row: report.RecoveryRow) -> str:
    return "-" if row.seconds is None else f"{row.seconds:.1f}s"


# --- the card map in a terminal -----------------------------------------------------------------
def card_map_text(cards: report.CardMap, *, color: bool) -> str:
    """Racks, then one line per node with one mark per card, then the legend with counts."""
    width = max((len(n.name) for r in cards.racks for n in r.nodes), default=0)
    lines = [f"SuperNode {cards.supernode}"]
    for rack in cards.racks:
        lines.append(f"  rack {rack.name}")
        lines += [f"    {n.name.ljust(width)}  {_marks(n.cells, color)}" for n in rack.nodes]
    lines.append(legend(cards.counts(), color=color))
    return "\n".join(lines)


def _marks(cells: Iterable[Owner], color: bool) -> str:
    return " ".join(_mark(c, color) for c in cells)


def _mark(owner: Owner, color: bool) -> str:
    if not color:
        return LETTER[owner]
    return f"\x1b[{ANSI[owner]}m\u25a0\x1b[0m"  # a filled square


def legend(counts: Counter[Owner], *, color: bool) -> str:
    """``■ inference 16  ■ training 32 ...``: every owner with its card count."""
    return "  ".join(f"{_mark(o, color)} {o.value} {counts[o]}" for o in Owner)


# --- the card map as a PNG --------------------------------------------------------------------
def png_size(cards: report.CardMap) -> tuple[int, int]:
    """(width, height) in pixels of the card map's image."""
    widths = [_rack_width(r) for r in cards.racks]
    width = sum(widths) + RACK_GAP * max(0, len(widths) - 1) + 2 * GAP
    rows = max((len(r.nodes) for r in cards.racks), default=0)
    return max(width, 1), rows * (BLOCK + GAP) + GAP


def _rack_width(rack: report.Rack) -> int:
    cards = max((len(n.cells) for n in rack.nodes), default=0)
    return cards * (BLOCK + GAP) - GAP if cards else 0


def pixels(cards: report.CardMap) -> list[bytearray]:
    """The image as rows of RGB bytes."""
    width, height = png_size(cards)
    image = [bytearray(bytes(BACKGROUND) * width) for _ in range(height)]
    left = GAP
    for rack in cards.racks:
        for row, node in enumerate(rack.nodes):
            top = GAP + row * (BLOCK + GAP)
            for col, owner in enumerate(node.cells):
                _fill(image, left + col * (BLOCK + GAP), top, RGB[owner])
        left += _rack_width(rack) + RACK_GAP
    return image


def _fill(image: list[bytearray], x: int, y: int, rgb: tuple[int, int, int]) -> None:
    block = bytes(rgb) * BLOCK
    for row in image[y : y + BLOCK]:
        row[3 * x : 3 * (x + BLOCK)] = block


def encode_png(rows: Sequence[bytes | bytearray]) -> bytes:
    """An 8-bit RGB PNG of ``rows`` (equal lengths, 3 bytes a pixel), filter 0 on every row."""
    width, height = len(rows[0]) // 3, len(rows)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    raw = b"".join(b"\x00" + bytes(r) for r in rows)
    return b"".join(
        (
            b"\x89PNG\r\n\x1a\n",
            _chunk(b"IHDR", header),
            _chunk(b"IDAT", zlib.compress(raw, 9)),
            _chunk(b"IEND", b""),
        )
    )


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def write_png(cards: report.CardMap, path: Path) -> None:
    """Write the card map's image to ``path``."""
    path.write_bytes(encode_png(pixels(cards)))
