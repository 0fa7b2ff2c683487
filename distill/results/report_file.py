"""Where a run's ``report.md`` is, and the one section added to it after it is written.

``report.py`` renders the report (tables, plots: matplotlib and the evaluation types);
``mode=local``'s supervisor only puts its time split in place of the student's time table once
the student has written it.
The two share the file's name from here, so the supervisor starts without what rendering
needs (about 2 s of imports on every job).
"""

from __future__ import annotations

import os

REPORT_FILE = "report.md"
TIME_HEADING = "## Time"
"""The student's time table; ``mode=local`` replaces it with its split of the whole run's wall time."""


def append_section(run_dir: str, markdown: str) -> None:
    """Add a section to the end of an existing report.md (``mode=local``'s time split, which
    only the supervisor can measure, after the student wrote the report); no report, no-op."""
    path = os.path.join(run_dir, REPORT_FILE)
    if os.path.exists(path):
        with open(path, "a") as f:
            f.write("\n" + markdown + "\n")


def replace_section(run_dir: str, heading: str, markdown: str) -> None:
    """Put ``markdown`` in place of the report's section under ``heading`` (up to the next ``## ``
    heading), or at the end when there is none; no report, no-op. Why: ``mode=local``'s time split
    covers the student's own phases, so the report keeps one time table, not two with different totals."""
    path = os.path.join(run_dir, REPORT_FILE)
    if not os.path.exists(path):
        return
    with open(path) as f:
        text = f.read()
    start = text.find(heading + "\n")
    if start < 0:
        append_section(run_dir, markdown)
        return
    end = text.find("\n## ", start + len(heading))
    tail = text[end:] if end >= 0 else "\n"
    with open(path, "w") as f:
        f.write(text[:start] + markdown.rstrip("\n") + "\n" + tail)
