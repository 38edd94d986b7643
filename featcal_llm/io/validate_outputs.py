"""What a run writes may destroy nothing it reads: the output, the merge it (re)makes, `--log`'s file.

`validate` and `run` ask these before anything is written (docs/validate.md); `io/output_dir` holds the path tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from featcal_llm.errors import FeatCalError
from featcal_llm.io.block_sections import DataSpec
from featcal_llm.generation.store import choice_path, generated_folder, generated_set_paths
from featcal_llm.io.block import TILDE_NOT_EXPANDED, beside_recipe
from featcal_llm.io.data_files import data_path, looks_like_hub_id
from featcal_llm.io.output_dir import TEMPORARY_RECIPE_PREFIX, argument_problem, in_a_kept_sibling, inside, intermediate_dir, not_an_output, overwrites_input, same, unwritable
from featcal_llm.io.problems import Problem
from featcal_llm.io.recipe import _experts_of, read_recipe
from featcal_llm.io.references import is_hub_reference


def check_output(path: Path, output: Path, problems: list[Problem], notes: list[str], key: str = "featcal.output") -> None:
    """The output can be written (an existing earlier output is a note: `run --force` replaces it)."""
    problem = not_an_output(output)
    if problem is not None:
        problems.append(Problem(str(path), key, problem))
        return
    if output.exists():
        notes.append(f"{path}: {key}: {output} already exists (run needs --force, or force=True to calibrate(), to replace it)")
    problem = unwritable(output)
    if problem is not None:
        problems.append(Problem(str(path), key, problem))


def check_first_stage(path: Path, output: Path, featcal: Any, problems: list[Problem]) -> None:
    """A stack writes its first stage beside the output (`.NAME.regmean`, say) and replaces one an earlier run left: a
    file or a folder of other things there is refused as run's first stage refuses it, in its words."""
    problem = not_an_output(intermediate_dir(output, featcal.method[0]))
    if problem is not None:
        problems.append(Problem(str(path), "featcal.output", problem))


def recipe_inputs(path: Path, merge_config: Any, merged: str | None, tokenizer: str | None, data: dict[str, DataSpec]) -> dict[str, Path]:
    """The local files and directories a run reads, each named as the recipe names it: the recipe, its models, the
    merge, the tokenizer and the calibration files (hub ids are not on this disk)."""
    inputs = {} if path.name.startswith(TEMPORARY_RECIPE_PREFIX) else {f"the recipe {path}": path}  # the API's copy of
    # a dict recipe is written for the run and removed after it: no input of the user's
    references = [("base_model", merge_config.base_model)] if merge_config.base_model is not None else []
    references += [("the expert", reference) for reference in _experts_of(merge_config)]
    for key, reference in references:
        for model_path in (reference.model, reference.lora):
            if model_path is not None and not is_hub_reference(model_path):
                inputs[f"{key} {model_path.path}"] = Path(model_path.path)
    if merged:
        inputs[f"featcal.merged {merged}"] = Path(merged)
    if tokenizer and not looks_like_hub_id(tokenizer):
        inputs[f"featcal.tokenizer {tokenizer}"] = Path(tokenizer)
    for name, spec in data.items():
        if spec.path is not None and data_path(spec, path.parent).exists():
            inputs[f"featcal.data.{name}.path {spec.path}"] = data_path(spec, path.parent)
        prompts = spec.generate.prompts if spec.generate is not None else None
        if prompts is not None and beside_recipe(prompts, path.parent).exists():  # found as the run reads them
            inputs[f"featcal.data.{name}.generate.prompts {prompts}"] = beside_recipe(prompts, path.parent)
    return inputs


def check_writes(path: Path, override: Path | None, setting: Any, merge_config: Any, data: dict[str, DataSpec], problems: list[Problem]) -> None:
    """What the run writes destroys nothing it reads: the output (OUTPUT, else featcal.output), the merge where the run
    makes it (missing, or one it made and may make again), and the generated records' folder beside the output."""
    from featcal_llm.io.merge import staging_in_the_way
    from featcal_llm.io.merge_identity import MARKER

    merged, output = setting("merged"), override or (Path(setting("output")) if setting("output") else None)
    inputs = recipe_inputs(path, merge_config, merged, setting("tokenizer"), data)
    written = [("featcal.merged", merged), ("OUTPUT", str(override)) if override is not None else ("featcal.output", setting("output"))]
    for name, value in written:
        if isinstance(value, str) and value.startswith("~"):
            problems.append(Problem(str(path), name, f"{value}: {TILDE_NOT_EXPANDED}"))
    if output is not None:
        key = "OUTPUT" if override is not None else "featcal.output"
        generated = {} if not any(spec.generate is not None for spec in data.values()) else \
            {f"the generated records' folder {generated_folder(output)}": generated_folder(output)}
        problem = overwrites_input(output, {**inputs, **generated}, Path(merged) if merged else None)
        if problem is not None:
            problems.append(Problem(str(path), key, problem))
        elif generated:
            problems.extend(_generated_in_the_way(path, output, merge_config, data, inputs))
    if merged and Path(merged).is_dir():  # a model the merge reads, named as the merge: its merge would be calibrated as it
        models = {label: where for label, where in inputs.items() if label.startswith(("base_model ", "the expert "))}
        same = [label for label, where in models.items() if where.is_dir() and where.resolve() == Path(merged).resolve()]
        if same:
            problems.append(Problem(str(path), "featcal.merged", f"{merged} is {same[0]}, not the merge of the recipe's "
                                                               "models; name the merge's directory, or a new one for mergekit to write"))
    if merged and (problem := in_a_kept_sibling(Path(merged))) is not None:  # a run of that output would delete it
        problems.append(Problem(str(path), "featcal.merged", problem))
    elif merged and (not Path(merged).exists() or (Path(merged) / MARKER).is_file()):  # the merge run may (re)write
        others = {label: where for label, where in inputs.items() if label != f"featcal.merged {merged}"}
        problem = overwrites_input(Path(merged), others, what="merge") or (None if Path(merged).exists() else unwritable(Path(merged)))
        if problem is not None:
            problems.append(Problem(str(path), "featcal.merged", problem))
        elif (problem := staging_in_the_way(Path(merged))) is not None:
            problems.append(Problem(str(path), "featcal.merged", problem))


def _generated_in_the_way(path: Path, output: Path, merge_config: Any, data: dict[str, DataSpec],
                          inputs: dict[str, Path]) -> list[Problem]:
    """A file where the generated records' folder goes, or a folder where an expert's set or its record is written:
    run would sample (minutes on a GPU) and then fail in a traceback writing them."""
    folder = generated_folder(output)
    if folder.exists() and not folder.is_dir():
        return [Problem(str(path), "featcal.data", f"{folder} is a file: the records that generate: writes are kept in a "
                                                   "folder of that name beside the output; move it")]
    set_paths = generated_set_paths(output, [str(reference) for reference in _experts_of(merge_config)])
    found = []
    for name, spec in data.items():
        if spec.generate is None or name not in set_paths:
            continue
        for written in (*set_paths[name], choice_path(set_paths[name][0])):
            read = next((label for label, where in inputs.items() if same(written, where)), None)
            if read is not None:  # the run would overwrite it, calibrating on (or prompting with) what it replaced
                found.append(Problem(str(path), f"featcal.data.{name}.generate", f"{written} is also {read}, and the "
                                                                                 "expert's generated records are written there; move it"))
            elif written.is_dir():
                found.append(Problem(str(path), f"featcal.data.{name}.generate", f"{written} is a folder: the expert's "
                                                                                 "generated records are written to a file of that name; move it"))
    return found


def check_log_file(path: str | Path, output: str | Path | None, log: Path) -> None:
    """`run --log FILE` appends to FILE from the start, before any check: it may not be a file the run reads (a
    recipe or calibration file would be corrupted), nor lie inside the output or a merge the run writes (it would
    create that folder first, and be deleted with it), nor be a folder or lie under a file (the log could not be
    opened). A recipe that does not parse is left to the run's own checks."""
    if log.is_dir():
        raise FeatCalError(f"--log: {log} is a folder; name a file (the run appends its messages to it)")
    nearest = next((parent for parent in log.parents if parent.exists()), None)  # the folder the log's own are made in
    if nearest is not None and not nearest.is_dir():
        raise FeatCalError(f"--log: {log} lies under {nearest}, which is a file; name a file in a folder")
    parsed = read_recipe(path)
    if parsed.merge_config is None:
        return
    setting = parsed.setting
    for label, read in recipe_inputs(Path(path), parsed.merge_config, setting("merged"), setting("tokenizer"), parsed.data_entries()).items():
        if same(log, read) or inside(log, read):
            raise FeatCalError(f"--log: {log} is {'also' if same(log, read) else 'inside'} {label}, which the run reads; name another file")
    written = {"OUTPUT": output if argument_problem(output) is None else None} if output is not None else {"featcal.output": setting("output")}
    written["featcal.merged"] = setting("merged")
    for key, folder in written.items():
        if folder and inside(log, Path(folder)):
            raise FeatCalError(f"--log: {log} lies inside {key} {folder}, which the run writes as a whole; name a file outside it")
