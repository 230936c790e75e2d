"""trec_eval's interface to the one measure engine: its measure names and nicknames
(names.py), and its evaluation loop and output format (report.py), for `rankmeter eval`
used as a drop-in for `trec_eval` (usnistgov/trec_eval 10.0)."""
