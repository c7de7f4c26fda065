"""Read what draftlab runs wrote (``record.json`` files in run and sweep directories) and turn it into
paper-style tables (:mod:`analysis.table`) and side-by-side reports (:mod:`analysis.report`).

Nothing in ``src/draftlab`` imports this package; it depends only on the record contract documented in
:mod:`analysis.results`.
"""
