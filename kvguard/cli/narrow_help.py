"""Help that stays readable in a narrow terminal, for commands with many long vLLM flag names.

Typer's rich help lays the options out as a table of six columns and, when the terminal is narrow,
truncates the flag names to fit (``--gpu-memory-uti…``), so at 80 columns ``kvguard plan --help``
does not say which flags it takes. ``NarrowHelpCommand`` keeps the rich panels from ``WIDE``
columns on and, below, writes click's plain definition list: one flag (with its type) per entry,
its help wrapped beneath it when the name is long, grouped under the same panel titles. The width is
the terminal's (``COLUMNS`` when set), as rich reads it.
"""

from __future__ import annotations

import shutil

from typer.core import MARKUP_MODE_KEY, TyperCommand

WIDE = 100  # columns from which the rich table fits the longest flag names of `kvguard plan`


def terminal_columns() -> int:
    return shutil.get_terminal_size((80, 24)).columns


class NarrowHelpCommand(TyperCommand):
    def format_help(self, ctx, formatter) -> None:
        if terminal_columns() >= WIDE:
            return super().format_help(ctx, formatter)
        ctx.ensure_object(dict)
        if isinstance(ctx.obj, dict):
            ctx.obj[MARKUP_MODE_KEY] = None  # plain text: no rich escapes in the defaults
        formatter.width = terminal_columns()
        self.format_usage(ctx, formatter)
        self.format_help_text(ctx, formatter)
        self.format_options(ctx, formatter)
        self.format_epilog(ctx, formatter)

    def format_options(self, ctx, formatter) -> None:
        panels: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            panel = getattr(param, "rich_help_panel", None) or (
                "Arguments" if param.param_type_name == "argument" else "Options")
            panels.setdefault(panel, []).append((record[0], record[1].replace("\\[", "[")))
        for title, records in panels.items():
            with formatter.section(title):
                formatter.write_dl(records, col_max=34)
