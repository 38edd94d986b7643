"""The quality study's two settings and the recipes of every row, written as the product reads them.

Setting ``narrow``: three experts, each fully fine-tuned on one kind of real text (``real_data.KINDS``).
Setting ``broad``: one expert fine-tuned on a mix of the three kinds (as an instruction expert is) beside two
narrow ones (code, c): shipping the broad expert alone is the bar a merge must clear.
Setting ``allgap``: the narrow experts under Task Arithmetic at a weight of its own (``ALLGAP_WEIGHT`` each, not the
average), so that every expert beats the merge on its own text (``studies.allgap``, docs/studies/all-gap.md).

Every row is a recipe run from the workdir through ``featcal_llm.pipeline.run_recipe``; the first recipe of a
setting merges (mergekit Task Arithmetic, or a linear merge for RegMean++) and later ones reuse the merge.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIX = "mix"  # the broad expert's data: every kind's records interleaved
AS_TRAINED = "-bos"  # the cal and prompt records as the experts were trained and are scored: BOS first (quality.records_as_trained)


@dataclass(frozen=True)
class Setting:
    name: str
    experts: tuple[str, ...]  # data kinds the experts were trained on (``mix``: the broad expert)
    owners: dict[str, str]  # domain → the expert whose NLL (and predictions) the merge is measured against
    merge_weight: float | None = None  # Task Arithmetic weight per expert (None: the run's --merge-weight, 1/3)


ALLGAP_WEIGHT = 1.0  # measured in docs/studies/all-gap.md: at 1/3 the merge beats the code and C experts on their text
HALF_WEIGHT = 0.5  # the harder all-gap setting: experts trained longer, so that each leads the merge at Task Arithmetic ½
ALLGAP = "allgap"  # the first all-gap setting: the all-gap scripts' default
ALLGAP_SETTINGS = (ALLGAP, "allgap-half")

SETTINGS = {
    "narrow": Setting("narrow", ("code", "prose", "c"), {"code": "code", "prose": "prose", "c": "c"}),
    "broad": Setting("broad", (MIX, "code", "c"), {"code": "code", "prose": MIX, "c": "c"}),
    "allgap": Setting("allgap", ("code", "prose", "c"), {"code": "code", "prose": "prose", "c": "c"}, ALLGAP_WEIGHT),
    "allgap-half": Setting("allgap-half", ("code", "prose", "c"), {"code": "code", "prose": "prose", "c": "c"}, HALF_WEIGHT),
}


def expert_dir(kind: str) -> str:
    return f"experts/{'broad' if kind == MIX else kind}"


def expert_label(kind: str) -> str:
    return "expert:broad" if kind == MIX else f"expert:{kind}"


@dataclass(frozen=True)
class Row:
    """One calibrated model of a setting: its recipe's ``featcal:`` keys and where it starts from."""

    name: str
    method: str = "featcal"  # featcal, regmean++, or STACK
    keys: dict = field(default_factory=dict)  # extra featcal: keys (lambda, alpha, rho, reduction, samples)
    merged: str = "ta"  # ta (Task Arithmetic) or linear
    data: str = "cal"  # cal: the cal split; generate: the experts continue the cal records' beginnings; self: the
    # experts write from the start the product chooses (`generate:` with no prompts), with `sampling`'s keys
    samples: int | None = None  # generate, self: samples per expert
    sampling: tuple[tuple[str, float | str], ...] = ()  # self: more `generate:` keys (temperature, top_p, chat_template)
    records: int | None = None  # cal: records per expert (default: the run's --cal-records)
    weights: tuple[tuple[str, float], ...] = ()  # (data kind, data.<expert>.weight) for the experts that do not weigh 1
    settings: tuple[str, ...] = ()  # the settings the row is run in (empty: every setting)

    @property
    def generates(self) -> bool:
        """Whether the experts write this row's calibration text (its sets are timed, then removed for the next row)."""
        return self.data in ("generate", "self")


# (λ, α, ρ): the product's defaults are (1e-5, 0.15, 0.5), the earlier study's fixed setting (1e-3, 0.5, 1)
SWEEP = ((1e-3, 0.5, 1.0), (1e-3, 0.15, 0.5), (1e-1, 0.5, 1.0), (1e-5, 0.5, 1.0), (1e-3, 1.0, 1.0),
         (1e-3, 0.5, 0.5), (1e-3, 0.5, 1.5), (1e-2, 0.85, 1.0))
AUTO = {"lambda": "auto", "alpha": "auto", "rho": "auto"}
STACK = "[regmean++, featcal]"  # one run of the product: RegMean++ on the linear merge, then FeatCal on its result
HEAD = {"head": True}  # the LM head re-fitted after the last layer (λ 1e-5, α 1, ρ 0.5) in every run, not only where
# an expert changed it (`head: auto`, the default)


def sweep_name(lam: float, alpha: float, rho: float) -> str:
    return f"featcal λ{lam:g} α{alpha:g} ρ{rho:g}"


def expert_weights_key() -> str:
    """The recipe key of the experts' weighing rule: ``expert_weights`` where the product has it, else ``balance``."""
    from featcal_llm.io.block import FeatCalConfig

    fields = FeatCalConfig.model_fields
    return "expert_weights" if "expert_weights" in fields else "balance"


def paper_rule() -> dict:
    """The paper's rule: every expert and every token weighs 1, every expert teaches its own records, and the LM head
    stays merged."""
    from featcal_llm.io.block import FeatCalConfig

    teachers = {"teachers": "own"} if "teachers" in FeatCalConfig.model_fields else {}  # a key of later versions
    return {expert_weights_key(): "equal", "token_weights": "equal", "trailing_experts": "keep", **teachers, "head": False}


def rows(phase: str, sweep: tuple = SWEEP, samples: tuple[int, ...] = (64, 256)) -> list[Row]:
    """The rows of one phase, most important first."""
    allgap = ALLGAP_SETTINGS
    if phase == "allgap":  # today's defaults (nothing set), the paper's rule, and the defaults with `refine: true`
        return [Row("featcal defaults", settings=allgap), Row("featcal paper rule", keys=paper_rule(), settings=(*allgap, "broad")),
                Row("featcal defaults + refine", keys={"refine": True}, settings=allgap)]
    if phase == "single":  # the ceiling: calibrate toward one expert at a time (the others weigh 0)
        kinds = SETTINGS["allgap"].experts
        return [Row(f"featcal defaults, {kind} only", weights=tuple((k, 0.0) for k in kinds if k != kind), settings=allgap)
                for kind in kinds]
    if phase == "allgap-levers":  # closed-form levers the product already has, each beside the defaults
        return [Row("featcal defaults + norms", keys={"norms": True}, settings=allgap),
                Row("featcal defaults + head", keys=HEAD, settings=allgap),
                Row("featcal defaults, head: false", keys={"head": False}, settings=(*allgap, "broad")),
                Row("featcal defaults, trailing_experts: keep", keys={"trailing_experts": "keep"}, settings=(*allgap, "broad"))]
    if phase == "core":
        return [Row("featcal defaults"), Row("featcal defaults, 256 records", records=256)]
    if phase == "regmean":
        return [Row("regmean++", method="regmean++", merged="linear"),
                Row("regmean++, 256 records", method="regmean++", merged="linear", records=256),
                Row("stack: regmean++ → featcal defaults, 256 records", method=STACK, merged="linear", records=256)]
    if phase == "generate":
        return [Row(f"featcal defaults{head}, generate {n}", keys=keys, data="generate", samples=n)
                for n in samples for head, keys in (("", {}), (" + head", HEAD))]
    if phase == "self":  # data-free: each expert writes its calibration text from the start the product chooses
        return [Row(f"featcal defaults, generate {{}} 64{label}", data="self", samples=64, sampling=sampling)
                for label, sampling in (("", ()), (", temperature 1", (("temperature", 1.0),)),
                                        (", temperature 1, top_p 0.9", (("temperature", 1.0), ("top_p", 0.9))),
                                        (", temperature 1, min_p 0.1", (("temperature", 1.0), ("min_p", 0.1))))] \
            + [Row("featcal defaults, generate {} 64 + refine", keys={"refine": True}, data="self", samples=64),
               # twice the real rows' count: a data-free user can have the experts write as many as the time allows
               Row("featcal defaults, generate {} 128", data="self", samples=128),
               Row("featcal defaults, generate {} 128 + refine", keys={"refine": True}, data="self", samples=128),
               # the product's own count when `generate:` names none (featcal.samples, 256)
               Row("featcal defaults, generate {} 256", data="self", samples=256),
               Row("featcal defaults, generate {} 256 + refine", keys={"refine": True}, data="self", samples=256),
               # every expert writes from its BOS token (raw text, as these experts were trained), not the start measured
               Row("featcal defaults, generate {} 64, chat_template off", data="self", samples=64,
                   sampling=(("chat_template", "off"),))]
    if phase == "weights":  # the broad expert covers three kinds: weigh it as three experts, or calibrate toward it alone
        broad = ("broad",)
        return [Row("featcal defaults, broad weight 3", weights=((MIX, 3.0),), settings=broad),
                Row("featcal defaults, broad only", weights=(("code", 0.0), ("c", 0.0)), settings=broad),
                Row("featcal defaults, 256 records, broad weight 3", records=256, weights=((MIX, 3.0),), settings=broad),
                Row("featcal defaults, 256 records, broad only", records=256, weights=(("code", 0.0), ("c", 0.0)),
                    settings=broad)]
    if phase == "tokens":  # every token alike, or by the expert's lead over the merge (expert_lead, featcal-llm's default)
        return [Row("featcal, token weights advantage", keys={"token_weights": "expert_lead"}),
                Row("featcal, token weights equal", keys={"token_weights": "equal"}),
                Row("featcal, token weights equal, 256 records", records=256, keys={"token_weights": "equal"}),
                Row("featcal, token weights advantage, 256 records", records=256, keys={"token_weights": "expert_lead"})]
    if phase == "balance":  # the experts' weights: all 1, or by coverage (expert_weights: coverage, featcal-llm's default)
        return [Row("featcal, balance equal", keys={"expert_weights": "equal"}),
                Row("featcal, balance coverage", keys={"expert_weights": "coverage"}),
                Row("featcal, balance equal, 256 records", records=256, keys={"expert_weights": "equal"}),
                Row("featcal, balance coverage, 256 records", records=256, keys={"expert_weights": "coverage"})]
    if phase == "head":
        return [Row("featcal defaults + head", keys=HEAD),
                Row("featcal defaults + head, 256 records", keys=HEAD, records=256),
                Row("featcal defaults + head α0.15", keys={"head": {"alpha": 0.15}}),
                Row("stack: regmean++ → featcal defaults", method=STACK, merged="linear")]
    if phase == "auto":
        return [Row("featcal auto", keys=AUTO), Row("stack: regmean++ → featcal auto", method=STACK, keys=AUTO, merged="linear")]
    if phase == "levers":
        return [Row("featcal auto, criterion output", keys={**AUTO, "tune": {"criterion": "output"}})]
    if phase == "sweep":
        return [Row(sweep_name(*point), keys={"lambda": point[0], "alpha": point[1], "rho": point[2]})
                for point in sweep]
    raise ValueError(phase)


PHASES = ("allgap", "single", "allgap-levers", "core", "balance", "tokens", "regmean", "generate", "self", "weights", "head", "auto", "levers", "sweep")


def _yaml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value) if not isinstance(value, float) else f"{value:g}" if "e" not in f"{value:g}" else f"{value:.0e}"


def recipe_text(setting: Setting, row: Row, output: str, merged: str, *, record_tokens: int, prompt_tokens: int,
                cal_records: int, seed: int, device: str, dtype: str, merge_weight: float) -> str:
    """A mergekit recipe (Task Arithmetic, or linear with the base at weight 0 for RegMean++) with its featcal: block."""
    linear = row.merged == "linear"
    lines = [f"# written by studies.quality: setting {setting.name}, row {row.name}",
             f"merge_method: {'linear' if linear else 'task_arithmetic'}", "base_model: base", "models:"]
    for kind in setting.experts:
        weight = 1.0 if linear else setting.merge_weight if setting.merge_weight is not None else merge_weight
        lines += [f"  - model: {expert_dir(kind)}", f"    parameters: {{weight: {weight}}}"]
    if linear:
        lines += ["  - model: base", "    parameters: {weight: 0.0}"]
    lines += ["dtype: float32", "featcal:"]
    if row.method != "featcal":
        lines.append(f"  method: {row.method}")
    lines += [f"  merged: {merged}", f"  output: {output}", "  data:"]
    for kind in setting.experts:
        if row.data == "cal":
            spec = f"{{path: data/{kind}/cal{AS_TRAINED}.jsonl, format: text}}"
        elif row.data == "self":
            keys = {"samples": row.samples, "max_new_tokens": record_tokens, **dict(row.sampling)}
            spec = f"{{generate: {_yaml_value(keys)}}}"
        else:
            spec = (f"{{generate: {{prompts: data/{kind}/prompts{AS_TRAINED}.jsonl, samples: {row.samples}, "
                    f"max_new_tokens: {record_tokens - prompt_tokens}, chat_template: \"off\", seed: {seed}}}}}")
        weight = dict(row.weights).get(kind)
        if weight is not None:
            spec = spec[:-1] + f", weight: {weight:g}}}"
        lines.append(f"    {expert_dir(kind)}: {spec}")
    if row.data == "cal":
        lines.append(f"  samples: {row.records or cal_records}")
    else:
        lines.append(f"  samples: {row.samples}")
    lines += [f"  max_length: {record_tokens + 1}", f"  device: {device}", f"  dtype: {dtype}"]
    lines += [f"  {key}: {_yaml_value(value)}" for key, value in row.keys.items()]
    return "\n".join(lines) + "\n"
