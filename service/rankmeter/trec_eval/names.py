"""trec_eval's measure names, parameters and nicknames, mapped onto the engine's measures.

`-m name[.params]` as trec_eval's trec_eval.c and meas_init.c read it: `P.5,10` (cut-offs
sorted, printed `P_5`, `P_10`), `iprec_at_recall.0.25` (printed `_%3.2f`),
`utility.2,-1,0,0` (printed `utility_2,-1,0,0`), nicknames `official`, `all_trec` and
`set` (measures.c). `P_5`-style names are accepted too. Columns come out in trec_eval's
order (its measure table), whatever the order on the command line. Where one name is
given twice with different parameters, trec_eval keeps only the first; here the cut-off
lists (CUT_OFF_LISTS) are merged and a second, different parameter of another measure
is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

from rankmeter.engine import Measure, parse
from rankmeter.engine.gains import finite_number as _number


class Column(NamedTuple):
    """One printed trec_eval value: its label, the engine measure (None: runid, num_q,
    relstring), how it prints (`double` %6.4f or `long`), its `all` line (`mean`, `sum`,
    `gm` geometric mean, `count`, `runid`, or `none`), and whether it has per-query lines."""
    label: str
    measure: Measure | None
    kind: str = "double"
    summary: str = "mean"
    per_query: bool = True
    points: tuple[float, ...] = ()  # 11pt_avg: the recall points averaged
    beta2: float | None = None      # set_F: its parameter, β²


class Options(NamedTuple):
    rounding: str = "lround"  # interpolated precision's recall rounding (trec_eval 10's)
    num_docs: int = 0         # -N


LONG_CUTS = (5, 10, 15, 20, 30, 100, 200, 500, 1000)
RECALL_POINTS = tuple(i / 10 for i in range(11))
Builder = Callable[[str | None, Options], list[Column]]


def _long_cuts(param: str | None, default: tuple[int, ...]) -> list[int]:
    if param is None:
        return list(default)
    cuts = sorted({int(_number(x, "cut-off ")) for x in param.split(",")})  # 23.4 is 23, as trec_eval's atol
    if cuts[0] <= 0:
        raise ValueError("cut-offs must be positive")
    return cuts


def _double_cuts(param: str | None, default: tuple[float, ...], check: Callable[[str, float], None]) -> list[float]:
    if param is None:
        return list(default)
    cuts = {}
    for text in param.split(","):
        cuts.setdefault(_number(text), text)
    for value, text in cuts.items():
        check(text, value)
    return sorted(cuts)


def _recall_point(text: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:  # trec_eval prints 0 above 1, and below 0 the value at 0
        raise ValueError(f"recall point {text} is not in 0..1")


def _multiple(text: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"multiple {text} of R must be positive")


def cutoff_text(value: float) -> str:
    """A cut-off as the engine's names write it (no exponent), to 17 decimals."""
    return f"{value:.17f}".rstrip("0").rstrip(".")


def single(name: str, ours: str, kind: str = "double", summary: str = "mean", per_query: bool = True) -> Builder:
    def build(param: str | None, opt: Options) -> list[Column]:
        if param is not None:
            raise ValueError(f"{name} takes no parameters")
        return [Column(name, parse(ours) if ours else None, kind, summary, per_query)]
    return build


def cut(name: str, ours: str, default: tuple, is_float: bool = False) -> Builder:
    def build(param: str | None, opt: Options) -> list[Column]:
        if is_float:
            iprec = ours == "IPrec"
            rounding = "(rounding=lround)" if iprec and opt.rounding == "lround" else ""
            points = _double_cuts(param, default, _recall_point if iprec else _multiple)
            return [Column(f"{name}_{c:3.2f}", parse(f"{ours}{rounding}@{cutoff_text(c)}")) for c in points]
        return [Column(f"{name}_{c}", parse(f"{ours}@{c}")) for c in _long_cuts(param, default)]
    return build


def _label(name: str, param: str | None) -> str:
    return name if param is None else f"{name}_{param}"


def eleven_point(param: str | None, opt: Options) -> list[Column]:
    points = tuple(_double_cuts(param, RECALL_POINTS, _recall_point))
    return [Column(_label("11pt_avg", param), None, points=points)]


def utility(param: str | None, opt: Options) -> list[Column]:
    values = [_number(x) for x in (param or "1,-1,0,0").split(",")]
    if len(values) != 4:
        raise ValueError("utility takes 4 coefficients")
    args = ",".join(f"p{i + 1}={v}" for i, v in enumerate(values))
    return [Column(_label("utility", param), parse(f"Utility({args},N={opt.num_docs})"))]


def set_f(param: str | None, opt: Options) -> list[Column]:
    """trec_eval's parameter is β² itself: computed from it in report.py, in m_set_F.c's order."""
    beta2 = 1.0 if param is None else _number(param)
    if beta2 < 0:
        raise ValueError(f"its parameter (β²) {param} must be 0 or more")
    return [Column(_label("set_F", param), None, beta2=beta2)]


def persistence(name: str, ours: str) -> Builder:
    def build(param: str | None, opt: Options) -> list[Column]:
        p = "0.9"
        for pair in (param or "").split(",") if param else []:
            key, _, value = pair.partition("=")
            if key == "p":
                p = repr(_number(value))
            elif not value:
                raise ValueError(f"malformed pair parameters in {param!r}")
            elif key.lstrip("+-").isascii() and key.lstrip("+-").isdigit():  # gain_init.c's valid_int: a relevance level's gain
                raise ValueError(f"gain parameters ({pair}) are not implemented")
            # Any other name is ignored, as trec_eval ignores it.
        return [Column(_label(name, param), parse(f"{ours}(p={p})"))]
    return build


def gained(name: str, ours: str) -> Builder:
    """ndcg, G, ndcg_rel, Rndcg: `level=gain` pairs (gain_init.c), other names ignored as
    trec_eval ignores them; a level below 0 (trec_eval's unjudged and unpooled documents) is
    refused."""
    def build(param: str | None, opt: Options) -> list[Column]:
        table: dict[int, float] = {}
        for pair in param.split(",") if param else []:
            key, _, value = pair.partition("=")
            if not value:
                raise ValueError(f"malformed pair parameters in {param!r}")
            body = key[1:] if key[:1] in ("+", "-") else key
            if not (body.isascii() and body.isdigit()):  # valid_int: not a level, ignored
                continue
            if int(key) < 0:
                raise ValueError(f"a gain for level {int(key)} (unjudged documents) is not supported")
            if int(key) in table:
                raise ValueError(f"level {int(key)} is given two gains")
            table[int(key)] = _number(value)
            if int(key) == 0 and table[0] > 0:  # level-0 documents would join the ideal ranking
                raise ValueError("a positive gain for level 0 is not implemented")
        gains = ";".join(f"{level}:{gain!r}" for level, gain in table.items())
        return [Column(_label(name, param), parse(f"{ours}(gains={gains})" if gains else ours))]
    return build


def relstring(param: str | None, opt: Options) -> list[Column]:
    length = 10 if param is None else int(_number(param))
    return [Column(_label("relstring", param), None, kind=str(length), summary="none")]


# trec_eval's measure table (measures.c), in its order; the ones left out are refused.
TABLE: dict[str, Builder] = {
    "runid": single("runid", "", summary="runid", per_query=False),
    "num_q": single("num_q", "", kind="long", summary="count", per_query=False),
    "num_ret": single("num_ret", "NumRet", kind="long", summary="sum"),
    "num_rel": single("num_rel", "NumRel", kind="long", summary="sum"),
    "num_rel_ret": single("num_rel_ret", "NumRelRet", kind="long", summary="sum"),
    "map": single("map", "AP"),
    "gm_map": single("gm_map", "AP", summary="gm", per_query=False),
    "Rprec": single("Rprec", "Rprec"),
    "bpref": single("bpref", "Bpref"),
    "recip_rank": single("recip_rank", "RR"),
    "iprec_at_recall": cut("iprec_at_recall", "IPrec", RECALL_POINTS, is_float=True),
    "P": cut("P", "P", LONG_CUTS),
    "relstring": relstring,
    "recall": cut("recall", "R", LONG_CUTS),
    "infAP": single("infAP", "infAP"),
    "gm_bpref": single("gm_bpref", "Bpref", summary="gm", per_query=False),
    "Rprec_mult": cut("Rprec_mult", "RprecMult", tuple(i / 5 for i in range(1, 11)), is_float=True),
    "utility": utility,
    "11pt_avg": eleven_point,
    "binG": single("binG", "BinG"),
    "G": gained("G", "G"),
    "ndcg": gained("ndcg", "nDCG"),
    "ndcg_rel": gained("ndcg_rel", "nDCGRel"),
    "Rndcg": gained("Rndcg", "RnDCG"),
    "ndcg_cut": cut("ndcg_cut", "nDCG", LONG_CUTS),
    "map_cut": cut("map_cut", "AP", LONG_CUTS),
    "relative_P": cut("relative_P", "RelP", LONG_CUTS),
    "success": cut("success", "Success", (1, 5, 10)),
    "set_P": single("set_P", "SetP"),
    "set_relative_P": single("set_relative_P", "SetRelP"),
    "set_recall": single("set_recall", "SetR"),
    "set_map": single("set_map", "SetAP"),
    "set_F": set_f,
    "num_nonrel_judged_ret": single("num_nonrel_judged_ret", "NumNonRelJudgedRet", kind="long", summary="sum"),
    "rbp": persistence("rbp", "RBP"),
    "rbp_resid": persistence("rbp_resid", "RBPResid"),
    "unj": cut("unj", "Unjudged", (5, 10, 20)),
}

# trec_eval measures not implemented yet: refused by name with this reason.
MISSING = {name: "not implemented yet" for name in ("dcg", "ideal_dcg", "ndcg_p", "yaap")}
MISSING.update({name: "a preference / judgment-group measure (-R prefs, qrels_prefs, qrels_jg): not supported"
                for name in ("prefs_num_prefs_poss", "prefs_num_prefs_ful", "prefs_num_prefs_ful_ret",
                             "prefs_simp", "prefs_pair", "prefs_avgjg", "prefs_avgjg_Rnonrel", "prefs_simp_ret",
                             "prefs_pair_ret", "prefs_avgjg_ret", "prefs_avgjg_Rnonrel_ret", "prefs_simp_imp",
                             "prefs_pair_imp", "prefs_avgjg_imp", "map_avgjg", "P_avgjg", "Rprec_mult_avgjg",
                             "all_prefs", "prefs", "qrels_jg")})

OFFICIAL = ["runid", "num_q", "num_ret", "num_rel", "num_rel_ret", "map", "gm_map", "Rprec", "bpref",
            "recip_rank", "iprec_at_recall", "P"]
ALL_TREC = OFFICIAL + ["relstring", "recall", "unj", "rbp", "rbp_resid", "infAP", "gm_bpref", "utility",
                       "11pt_avg", "ndcg", "relative_P", "Rprec_mult", "success", "map_cut", "ndcg_cut",
                       "ndcg_rel", "Rndcg", "binG", "G", "set_P", "set_recall", "set_relative_P", "set_map",
                       "set_F", "num_nonrel_judged_ret"]
NICKNAMES = {"official": OFFICIAL, "all_trec": ALL_TREC,
             "set": ["runid", "num_q", "num_ret", "num_rel", "num_rel_ret", "utility", "set_P", "set_recall",
                     "set_relative_P", "set_map", "set_F"]}


# Measures whose parameter is a list of cut-offs: a name given twice asks for both lists.
CUT_OFF_LISTS = {"P", "recall", "ndcg_cut", "map_cut", "relative_P", "success", "iprec_at_recall", "Rprec_mult",
                 "unj"}


def split(arg: str) -> tuple[str, str | None]:
    """`P.5,10` -> ("P", "5,10"); `P_5` -> ("P", "5"); `map` -> ("map", None)."""
    name, dot, param = arg.partition(".")
    if dot:
        if not param:
            raise ValueError(f"illegal measure {arg!r}: no parameter after the '.'")
        return name, param
    if name in TABLE or name in NICKNAMES or name in MISSING:
        return name, None
    base, _, suffix = name.rpartition("_")
    if base in TABLE:
        return base, suffix
    return name, None


def is_trec_name(arg: str) -> bool:
    name, dot, _ = arg.partition(".")
    if not dot:
        name, _ = split(arg)
    return name in TABLE or name in NICKNAMES or name in MISSING


def columns(args: Iterable[str], opt: Options, skip_missing: bool = False) -> tuple[list[Column], list[str]]:
    """The columns `-m` arguments ask for, in trec_eval's order, and the names of the
    measures a nickname asked for that are not implemented (left out when `skip_missing`,
    else refused)."""
    wanted: dict[str, str | None] = {}
    missing: list[str] = []
    for arg in args:
        name, param = split(arg)
        names = NICKNAMES.get(name, [name])
        for each in names:
            if each in MISSING:
                if not (skip_missing and name in NICKNAMES):
                    raise ValueError(f"illegal measure {arg!r}: {each} is {MISSING[each]}")
                missing.append(each)
            elif each not in TABLE:
                raise ValueError(f"illegal measure {arg!r}")
            elif each not in wanted or wanted[each] is None:
                wanted[each] = param if each == name else wanted.get(each)
            elif param is not None and each == name and param != wanted[each]:
                if each not in CUT_OFF_LISTS:  # a merged `0.5,4` would be nonsense; trec_eval keeps the first
                    raise ValueError(f"illegal measure {arg!r}: {each} is asked for as {each}.{wanted[each]} "
                                     f"already (one parameter per measure; trec_eval keeps the first)")
                wanted[each] = f"{wanted[each]},{param}"  # trec_eval keeps the first only
    out: list[Column] = []
    for name, build in TABLE.items():
        if name in wanted:
            try:
                out.extend(dict.fromkeys(build(wanted[name], opt)))
            except ValueError as e:
                raise ValueError(f"illegal measure {name!r}: {e}") from None
    return out, missing
