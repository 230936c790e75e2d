"""The metric engine: pure computation, no I/O, shared by `rankmeter serve` and `rankmeter eval`.

    QueryState (query.py)  one query's ranked list and grades, updated in place
    Batch, stack (batch.py)  many states as padded arrays; stack_scored: a TREC run's, directly
    parse, Measure (measures.py)  measure names and their definitions
    measures_trec.py  trec_eval's other measures (num_*, set_*, infAP, RBP, …), same registry
    macro, micro (aggregate.py)  averages over queries
    Clicks, evaluate_online (online.py)  the online signals (CTR, abandonment, …), same registry
"""

from rankmeter.engine.aggregate import Average, macro, micro
from rankmeter.engine.batch import Batch, stack, stack_scored
from rankmeter.engine.measures import FAMILIES, Measure, Ratio, evaluate, parse, parse_all
from rankmeter.engine import measures_trec  # noqa: F401  (registers trec_eval's other measures)
from rankmeter.engine.online import ONLINE_SIGNALS, Clicks, evaluate_online
from rankmeter.engine.query import QueryState

__all__ = ["Average", "Batch", "Clicks", "FAMILIES", "Measure", "ONLINE_SIGNALS", "QueryState", "Ratio",
           "evaluate", "evaluate_online", "macro", "micro", "parse", "parse_all", "stack",
           "stack_scored"]
