"""The device a results row was measured on, as the docs' tables name it: every rendered row carries it (rows of
an H100 and an H200 stand side by side in one results file, and their figures are not each other's).

Rows name it as ``device`` (bench/mfu.py from 2026-12-05, the ceilings' name) or ``gpu`` (before); files of the
multi-process benches name it once, in ``meta["gpu"]``, which their renders pass as the default.
"""

from __future__ import annotations


def device_of(row: dict, default: str | None = None) -> str | None:
    """The row's device name (``device``, else ``gpu``), else ``default`` (the file's)."""
    return row.get("device") or row.get("gpu") or default


def device_label(name: str | None) -> str:
    """"NVIDIA H200" -> "H200", "cpu" -> "CPU"; a row that does not say is rendered as such, never guessed."""
    if not name:
        return "not recorded"
    return "CPU" if name == "cpu" else name.removeprefix("NVIDIA ")


def device_slug(name: str) -> str:
    """A results file's suffix: "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA H200" -> "h200", "cpu" -> "cpu"."""
    return "".join(c for c in device_label(name).split()[0].lower() if c.isalnum())
