"""Checkpoint integrity: every damaged file is named, and the previous checkpoint offered."""

import os
from pathlib import Path

import pytest
import torch

from tessera.testing import run_distributed
from tessera.train import checkpoint as ckpt


def _save_two(rank, world_size, root):
    def listed():
        return sorted(p.name for p in Path(root).iterdir())

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    for step in (1, 2):
        ckpt.save_checkpoint(Path(root), step, model, optimizer, {"model": {"class": "Linear"}})
    names = listed()
    # Step 2 saved again (a run resumed from step 1): replaced whole, nothing left aside.
    ckpt.save_checkpoint(Path(root), 2, model, optimizer, {"again": 1})
    again = (listed(), ckpt.read_meta(Path(root) / "step_00000002"))
    # ... and when putting the new one in place fails, the old one is back under its name.
    real_replace = os.replace

    def failing(src, dst):
        if str(src).endswith(".partial"):
            raise OSError(5, "Input/output error")
        real_replace(src, dst)

    os.replace = failing
    try:
        ckpt.save_checkpoint(Path(root), 2, model, optimizer, {"again": 2})
        failed = None
    except ckpt.CheckpointError as err:
        failed = str(err)
    finally:
        os.replace = real_replace
    kept = (listed(), ckpt.read_meta(Path(root) / "step_00000002"))
    return {"names": names, "again": again, "failed": failed, "kept": kept}


def test_damaged_checkpoints_are_named(tmp_path):
    saved = run_distributed(_save_two, world_size=1, args=(str(tmp_path),))[0]
    assert saved["names"] == ["latest", "step_00000001", "step_00000002"]
    names, meta = saved["again"]
    assert names == saved["names"] and meta["again"] == 1
    assert "Input/output error" in saved["failed"]
    names, meta = saved["kept"]
    assert names == saved["names"] and meta["again"] == 1  # the save before the failed one
    latest = ckpt.find_latest(tmp_path)
    assert latest.name == "step_00000002"
    meta = ckpt.verify_checkpoint(latest)
    assert meta["step"] == 2 and ".metadata" in meta["files"]

    shard = next(latest.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, one byte changed
    shard.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=f"{shard.name} does not match its sha256"):
        ckpt.verify_checkpoint(latest)
    ckpt.verify_checkpoint(latest, hashes=False)  # sizes alone do not see it

    shard.unlink()
    with pytest.raises(ckpt.CheckpointError, match=r"is missing.*previous complete checkpoint "
                                                   r"is .*step_00000001"):
        ckpt.verify_checkpoint(latest)
    first = tmp_path / "step_00000001"
    (first / ".metadata").write_bytes(b"x")
    with pytest.raises(ckpt.CheckpointError, match="No earlier complete checkpoint"):
        ckpt.verify_checkpoint(first)
    (first / ckpt.META).write_text("{not json")
    with pytest.raises(ckpt.CheckpointError, match="meta.json is corrupted"):
        ckpt.read_meta(first)


def _save_with_one_rank_failing(rank, world_size, root):
    root = Path(root)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    if rank == 0:  # a save a kill cut short, in an earlier run
        (root / ".step_00000009.partial").mkdir(parents=True)
    ckpt.save_checkpoint(root, 1, model, optimizer, {})
    errors = []

    def no_space(*args):
        raise OSError(28, "No space left on device")

    # Rank 1 cannot write its RNG state; then rank 0 alone cannot write the manifest. Before,
    # the other rank waited in a barrier until the collective timeout (30 minutes by default).
    for failing_rank, helper in ((1, "_save_durably"), (0, "_manifest")):
        original = getattr(ckpt, helper)
        if rank == failing_rank:
            setattr(ckpt, helper, no_space)
        try:
            ckpt.save_checkpoint(root, 2, model, optimizer, {})
        except ckpt.CheckpointError as err:
            errors.append(str(err))
        finally:
            setattr(ckpt, helper, original)
    return {"errors": errors, "files": sorted(p.name for p in root.iterdir()),
            "latest": ckpt.find_latest(root).name}


def test_a_save_failing_on_one_rank_is_raised_on_every_rank_and_loses_nothing(tmp_path):
    results = run_distributed(_save_with_one_rank_failing, world_size=2, args=(str(tmp_path),),
                              collective_timeout_s=60)
    for result in results:
        assert len(result["errors"]) == 2
        assert "step 2 failed (rank 1: [Errno 28] No space left" in result["errors"][0]
        assert "step 2 failed (rank 0: [Errno 28] No space left" in result["errors"][1]
        assert "no complete checkpoint in" in result["errors"][1]
        # The first checkpoint stands; neither failed save nor the leftover is left behind.
        assert result["files"] == ["latest", "step_00000001"]
        assert result["latest"] == "step_00000001"


def test_a_checkpoint_path_that_does_not_exist_is_named_so(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match=r"step_3 does not exist .*step_00000003"):
        ckpt.read_meta(tmp_path / "checkpoints" / "step_3")
    (tmp_path / "half").mkdir()
    with pytest.raises(ckpt.CheckpointError, match="is not a complete checkpoint"):
        ckpt.read_meta(tmp_path / "half")


def test_pruning_keeps_the_checkpoint_just_written_and_drops_an_abandoned_continuation(
        tmp_path):
    from tessera.train.checkpoint import META, _prune, list_complete, step_dirname

    def save(step):
        (tmp_path / step_dirname(step)).mkdir()
        (tmp_path / step_dirname(step) / META).write_text("{}")
        return tmp_path / step_dirname(step)

    # A run saved steps 2 and 4, resumed from step 2 and saved step 3: step 4 belongs to the
    # continuation it abandoned. Pruning by number alone deleted step 3, the one just written.
    save(2), save(4)
    _prune(tmp_path, 2, save(3))
    assert [p.name for p in list_complete(tmp_path)] == [step_dirname(2), step_dirname(3)]
    _prune(tmp_path, 1, tmp_path / step_dirname(3))
    assert [p.name for p in list_complete(tmp_path)] == [step_dirname(3)]
    # A run going forward: the oldest go.
    save(5), save(6)
    _prune(tmp_path, 2, save(7))
    assert [p.name for p in list_complete(tmp_path)] == [step_dirname(6), step_dirname(7)]


def test_a_hugging_face_checkpoint_of_other_heads_is_refused_naming_them(tmp_path):
    from tessera.models.config import preset
    from tessera.models.hf import build_hf_model, hf_config_from_reference
    from tessera.train.model_identity import describe_model

    def gpt2(**fields):
        return build_hf_model("gpt2", **{**hf_config_from_reference("gpt2", preset("tiny")),
                                         **fields})

    saved = {"model": describe_model(gpt2())}
    ckpt.check_compatible(saved, describe_model(gpt2()), tmp_path)
    # Same parameter shapes, another model: until 2026-11-28 a Hugging Face model's
    # checkpoint recorded class and shapes only, and this resumed without a word.
    with pytest.raises(ckpt.CheckpointError, match="n_head: checkpoint 4 vs run 2"):
        ckpt.check_compatible(saved, describe_model(gpt2(n_head=2)), tmp_path)
    # Names, token ids and output switches are not the model's computation.
    ckpt.check_compatible(saved, describe_model(gpt2(eos_token_id=7, output_attentions=True)),
                          tmp_path)
    # A checkpoint that recorded no config fields (before then) is compared on shapes.
    shapes_only = {"model": {k: saved["model"][k] for k in
                             ("class", "num_params", "parameter_shapes_sha256")}}
    ckpt.check_compatible(shapes_only, describe_model(gpt2(n_head=2)), tmp_path)


def test_a_copied_checkpoint_folder_is_neither_listed_nor_pruned(tmp_path):
    from tessera.train.checkpoint import META, _prune, list_complete, step_dirname

    for name in (step_dirname(2), step_dirname(4) + "_backup", step_dirname(5)):
        (tmp_path / name).mkdir()
        (tmp_path / name / META).write_text("{}")
    # Until 2026-11-28 the copy was listed, and pruning failed on its name (on rank 0 only,
    # inside a save: the other ranks waited in the next barrier).
    assert [p.name for p in list_complete(tmp_path)] == [step_dirname(2), step_dirname(5)]
    _prune(tmp_path, 1, tmp_path / step_dirname(5))
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dirname(4) + "_backup",
                                                          step_dirname(5)]


def test_config_fields_that_do_not_change_the_model_are_left_out_inside_sub_configs_too():
    from tessera.train.model_identity import _functional

    # A multimodal model's text_config: its dtype or use_cache no more its identity than the
    # top level's (before, a resume of such a model could be refused over them).
    fields = {"hidden_size": 8, "dtype": "float32", "_commit_hash": "x",
              "text_config": {"dtype": "bfloat16", "use_cache": True, "num_heads": 2}}
    assert _functional(fields) == {"hidden_size": 8, "text_config": {"num_heads": 2}}
    # Compared field by field there too: a field the checkpoint lacks is not compared.
    saved = {"model": {"text_config": {"num_heads": 2}}}
    ckpt.check_compatible(saved, {"text_config": {"num_heads": 2, "new": 1}}, Path("c"))
    with pytest.raises(ckpt.CheckpointError, match="text_config.num_heads: checkpoint 2 vs "
                                                   "run 4"):
        ckpt.check_compatible(saved, {"text_config": {"num_heads": 4}}, Path("c"))
