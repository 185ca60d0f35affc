"""The plugin's drawing (matrixpool.kubectl.render): tables, the terminal card map, and the PNG
card map decoded back with zlib to count pixels per owner colour."""

from __future__ import annotations

import struct
import zlib
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import pytest

from matrixpool.kubectl import render, report
from matrixpool.kubectl.report import Owner

T, N, S, X, F, D = (
    Owner.TRAINING,
    Owner.INFERENCE,
    Owner.SPARE,
    Owner.UNHEALTHY,
    Owner.FREE,
    Owner.DOWN,
)


def card_map(*racks: list[tuple[Owner, ...]]) -> report.CardMap:
    return report.CardMap(
        "sn-0",
        tuple(
            report.Rack(
                f"rack-{r}",
                tuple(report.NodeCells(f"node-{r}{n}", cells) for n, cells in enumerate(nodes)),
            )
            for r, nodes in enumerate(racks)
        ),
    )


def decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, RGB rows) of an 8-bit RGB PNG with filter 0 on every row."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks: dict[bytes, bytes] = {}
    offset = 8
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind, body = data[offset + 4 : offset + 8], data[offset + 8 : offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length : offset + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks[kind] = chunks.get(kind, b"") + body
        offset += 12 + length
    width, height, depth, color_type, _, _, _ = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, color_type) == (8, 2)
    raw = zlib.decompress(chunks[b"IDAT"])
    stride = 1 + 3 * width
    rows = [raw[y * stride : (y + 1) * stride] for y in range(height)]
    assert all(row[0] == 0 for row in rows)
    return width, height, [row[1:] for row in rows]


def colour_counts(rows: list[bytes]) -> Counter[tuple[int, int, int]]:
    return Counter((row[x], row[x + 1], row[x + 2]) for row in rows for x in range(0, len(row), 3))


MAPS = {
    "one node of one rack": card_map([(T, T, N, N, S, X, F, D)]),
    "two racks of different sizes": card_map(
        [(T,) * 8, (N,) * 8, (S,) * 8], [(F, F, X, F, F, F, F, F)]
    ),
    "a rack whose node went down": card_map([(D,) * 4, (T, T, F, F)]),
}


@pytest.mark.parametrize("name", MAPS)
def test_png_has_block_area_pixels_of_each_owners_colour_per_card(
    name: str, tmp_path: Path
) -> None:
    cards = MAPS[name]
    path = tmp_path / "cards.png"
    render.write_png(cards, path)
    width, height, rows = decode_png(path.read_bytes())
    assert (width, height) == render.png_size(cards)
    counts = colour_counts(rows)
    area = render.BLOCK * render.BLOCK
    for owner in Owner:
        assert counts[render.RGB[owner]] == cards.counts()[owner] * area, owner
    owners = sum(cards.counts().values()) * area
    assert counts[render.BACKGROUND] == width * height - owners


def test_owner_colours_are_distinct_from_each_other_and_the_background() -> None:
    colours = [*render.RGB.values(), render.BACKGROUND]
    assert len(set(colours)) == len(colours)


def test_card_map_text_without_colour_shows_a_letter_per_card_and_the_legend() -> None:
    text = render.card_map_text(card_map([(T, N, S, X)], [(F, D, F, F)]), color=False)
    assert text.splitlines() == [
        "SuperNode sn-0",
        "  rack rack-0",
        "    node-00  T I S X",
        "  rack rack-1",
        "    node-10  . D . .",
        "I inference 1  T training 1  S spare 1  X unhealthy 1  . free 3  D down 1",
    ]


def test_card_map_text_with_colour_uses_ansi_escapes() -> None:
    text = render.card_map_text(card_map([(T, N)]), color=True)
    assert "\x1b[32m" in text
    assert "\x1b[34m" in text
    assert text.count("\x1b[0m") == 2 + len(Owner)  # each card, each legend entry


def test_status_table_aligns_columns_and_shows_a_dash_for_empty_cells() -> None:
    row = report.StatusRow("sn-0", 16, 32, 8, 2, 318, 48, 48, "", "")
    lines = render.status_table([row]).splitlines()
    assert lines[0].split() == [
        "SUPERNODE",
        "INFERENCE",
        "TRAINING",
        "SPARE",
        "UNHEALTHY",
        "FREE",
        "NODES",
        "WINDOW",
        "NEXT-TRANSITION",
        "LAST-TRANSITION",
    ]
    assert lines[1].split() == ["sn-0", "16", "32", "8", "2", "318", "48/48", "-", "-", "-"]
    assert lines[0].index("TRAINING") == lines[1].index("32")


def test_status_table_shows_the_window_and_the_last_transition() -> None:
    row = report.StatusRow(
        "sn-0", 0, 352, 8, 0, 24, 48, 48, "night", "2026-12-02T00:00:00+00:00", "night 2.7s"
    )
    lines = render.status_table([row]).splitlines()
    assert lines[1].split()[-5:] == ["48/48", "night", "2026-12-02T00:00:00+00:00", "night", "2.7s"]
    assert lines[1].endswith("night 2.7s")


def test_recoveries_text_says_so_when_there_were_none() -> None:
    assert render.recoveries_text("llm", []) == "llm: no recoveries"


def test_recoveries_text_is_a_timeline_with_durations() -> None:
    start = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
    done = report.RecoveryRow(
        "InPlace", "PodFailed on n-3", 120, 7, start, start.replace(second=12), "r1-a", (3,)
    )
    ongoing = report.RecoveryRow(
        "SpareSwap",
        "NodeDown on n-1",
        None,
        None,
        start,
        None,
        "r2-b",
        (4, 5, 6, 7),
        (("n-1", "n-9"),),
    )
    lines = render.recoveries_text("llm", [done, ongoing]).splitlines()
    assert lines[0].split() == [
        "#",
        "ID",
        "LEVEL",
        "RESTORED-STEP",
        "LOST-STEPS",
        "RANKS",
        "MOVES",
        "DETECTED",
        "RECOVERED",
        "TOOK",
        "CAUSE",
    ]
    assert lines[1].split()[:7] == ["1", "r1-a", "InPlace", "120", "7", "3", "-"]
    assert lines[1].split()[-4:] == ["12.0s", "PodFailed", "on", "n-3"]
    assert lines[2].split()[:7] == ["2", "r2-b", "SpareSwap", "-", "-", "4-7", "n-1->n-9"]
    assert "(recovering)" in lines[2]
    assert lines[2].split()[-4:] == ["-", "NodeDown", "on", "n-1"]
