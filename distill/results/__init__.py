"""What a run leaves behind: the exported student, ``report.md`` (+ plots), ``result.json``,
and a sweep's ``summary.md``. The one writer of each of them."""
