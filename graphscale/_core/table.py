"""The one text-table formatter: every table graphscale prints (explain,
audit, the demo) is made here."""
from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_table"]


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], rule: bool = True) -> str:
    """Left-aligned columns two spaces apart, each line indented by two; a
    dashed rule under the header when ``rule``.  Every table graphscale
    prints (explain, audit, the demo) is made here."""
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return ("  " + "  ".join(v.ljust(w) for v, w in zip(cells, widths))).rstrip()

    lines = [line(header)]
    if rule:
        lines.append(line(["-" * w for w in widths]))
    lines += [line(r) for r in rows]
    return "\n".join(lines)
