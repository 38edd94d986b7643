"""A merge that fails is named for what failed: the hub during a download, mergekit reading an input, or the merge's own
files (a full disk); each in one line, with no merged folder or staging folder left behind."""

from __future__ import annotations

import errno

import pytest
from click.testing import CliRunner

from featcal_llm.cli import main
from featcal_llm.io.merge import staging_folder


def _failing_merge(monkeypatch, error_for):
    import mergekit.merge

    def failing(config, out_path, **kwargs):
        raise error_for(out_path)

    monkeypatch.setattr(mergekit.merge, "run_merge", failing)


@pytest.mark.parametrize("error_for, says", [
    (lambda out: __import__("huggingface_hub.errors", fromlist=["x"]).LocalEntryNotFoundError(
        "An error happened while trying to locate the file on the Hub and we cannot find the requested files in the "
        "local cache. Please check your connection and try again."),
     "mergekit could not download an input from the Hugging Face hub during the merge (An error happened while trying "
     "to locate the file on the Hub and we cannot find the requested files in the local cache. Please check your "
     "connection and try again.); check the connection and the model ids, then run again"),
    (lambda out: __import__("huggingface_hub.errors", fromlist=["x"]).OfflineModeIsEnabled(
        "Cannot reach https://huggingface.co/api/models/org/expert: offline mode is enabled."),
     "mergekit could not download an input from the Hugging Face hub during the merge (Cannot reach "
     "https://huggingface.co/api/models/org/expert: offline mode is enabled.); check the connection and the model ids, "
     "then run again"),
    (lambda out: PermissionError(errno.EACCES, "Permission denied", "/elsewhere/expert/model.safetensors"),
     "mergekit failed to merge the recipe: [Errno 13] Permission denied: '/elsewhere/expert/model.safetensors'"),
    (lambda out: OSError(errno.ENOSPC, "No space left on device", f"{out}/model-00001-of-00002.safetensors"),
     "featcal.merged: {merged}: cannot write the merge (No space left on device)"),
    (lambda out: OSError(errno.ENOSPC, "No space left on device"),
     "featcal.merged: {merged}: cannot write the merge (No space left on device)"),
], ids=["hub-entry", "hub-offline", "input-unreadable", "disk-full-named", "disk-full-unnamed"])
def test_a_failed_merge_names_what_failed(small, tmp_path, monkeypatch, error_for, says):
    _failing_merge(monkeypatch, error_for)
    merged = tmp_path / "merged"
    recipe = small.write_recipe(tmp_path / "r.yaml", merged=str(merged), output=str(tmp_path / "out"))
    result = CliRunner().invoke(main, ["run", "-q", str(recipe)])
    assert result.exit_code == 1
    assert result.stderr.splitlines()[0] == f"featcal-llm: error: {recipe}: " + says.format(merged=merged)
    assert not merged.exists() and not staging_folder(merged).exists() and not (tmp_path / "out").exists()
