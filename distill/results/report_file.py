"""Where a run's ``report.md`` is, and the one section added to it after it is written.

``report.py`` renders the report (tables, plots: matplotlib and the evaluation types);
``mode=local``'s supervisor only appends its time split once the student has written it.
The two share the file's name from here, so the supervisor starts without what rendering
needs (about 2 s of imports on every job).
"""

from __future__ import annotations

import os

REPORT_FILE = "report.md"


def append_section(run_dir: str, markdown: str) -> None:
    """Add a section to the end of an existing report.md (``mode=local``'s time split, which
    only the supervisor can measure, after the student wrote the report); no report, no-op."""
    path = os.path.join(run_dir, REPORT_FILE)
    if os.path.exists(path):
        with open(path, "a") as f:
            f.write("\n" + markdown + "\n")
