"""The KV memory report: where the pool's bytes go, and what paging saves.

The engine builds the numbers (a dict, see `REPORT_KEYS`); this module only words them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

REPORT_KEYS = ("pool_bytes", "num_blocks", "block_size", "num_blocks_free", "num_blocks_cached",
               "tokens_held", "slots_reserved", "slots_unused", "contiguous_reservation_tokens",
               "contiguous_reservation_bytes")


def format_bytes(num_bytes: float) -> str:
    """Binary units: 512 B, 8.0 KiB, 1.5 GiB."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "n/a"


def format_kv_memory_report(report: Mapping[str, Any]) -> str:
    """Words the engine's KV memory numbers as a few lines of text.

    Args:
        report: every key of `REPORT_KEYS`; the slot and token counts cover running requests,
            `contiguous_reservation_*` is what reserving `max_model_len` contiguous slots per
            running request (the pre-paging way) would take. An optional `kv_cache_dtype`
            (e.g. 'fp8_e4m3') is named beside the bytes per slot, which it halves against bf16.
            A mixed model's KV cache groups add `reserved_bytes` (both groups' blocks held by
            running requests), `full_pool_bytes`, `sliding_*` and `max_concurrency`: the block
            counts are then the full-attention layers', the bytes per slot the whole pool's
            over their slots.

    Raises:
        ValueError: naming the keys that are missing.
    """
    missing = [key for key in REPORT_KEYS if key not in report]
    if missing:
        raise ValueError(f"KV memory report lacks {missing}; it needs {list(REPORT_KEYS)}.")
    n = {key: int(report[key]) for key in REPORT_KEYS}
    num_slots = n["num_blocks"] * n["block_size"]
    slot_bytes = n["pool_bytes"] / num_slots if num_slots else 0.0
    contiguous, reserved = n["contiguous_reservation_tokens"], n["slots_reserved"]
    ratio = f"{contiguous / reserved:.1f}x" if reserved else "n/a"
    dtype = f", {report['kv_cache_dtype']}" if report.get("kv_cache_dtype") else ""
    reserved_bytes = float(report.get("reserved_bytes", reserved * slot_bytes))
    return "\n".join([*_lines(n, num_slots, slot_bytes, contiguous, reserved, reserved_bytes, ratio, dtype),
                      *_group_lines(report)])


def _lines(n: dict[str, int], num_slots: int, slot_bytes: float, contiguous: int, reserved: int,
           reserved_bytes: float, ratio: str, dtype: str) -> list[str]:
    return [
        f"KV cache pool: {format_bytes(n['pool_bytes'])}, {n['num_blocks']} blocks x "
        f"{n['block_size']} tokens = {num_slots} token slots ({format_bytes(slot_bytes)} per slot{dtype})",
        f"  blocks: {n['num_blocks'] - n['num_blocks_free']} in use, {n['num_blocks_free']} free, "
        f"{n['num_blocks_cached']} holding cached prefixes",
        f"  running requests: {n['tokens_held']} tokens held in {reserved} reserved slots "
        f"({format_bytes(reserved_bytes)}); {n['slots_unused']} slots unused "
        f"({_percent(n['slots_unused'], reserved)} of reserved)",
        f"  contiguous max-length reservation for the same requests: {contiguous} slots "
        f"({format_bytes(n['contiguous_reservation_bytes'])}), {ratio} what paging reserves",
    ]


def _group_lines(report: Mapping[str, Any]) -> list[str]:
    """A mixed model's KV cache groups (optional keys `sliding_*`, `full_pool_bytes`,
    `max_concurrency`): the block counts above are the full-attention layers', whose blocks
    hold every token; the sliding-window layers' hold only their window's."""
    if "sliding_window" not in report:
        return []
    window, total, free = (int(report[k]) for k in ("sliding_window", "sliding_num_blocks",
                                                    "sliding_num_blocks_free"))
    return [
        f"  full-attention layers: {format_bytes(report['full_pool_bytes'])}; sliding-window layers "
        f"(window {window}): {format_bytes(report['sliding_pool_bytes'])}, {total} blocks, "
        f"{total - free - 1} in use, {free} free",
        f"  maximum concurrency at max_model_len: {report['max_concurrency']:.2f}x",
    ]
