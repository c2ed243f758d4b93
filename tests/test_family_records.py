"""The family records (`vit_keras.weights.families`): each is found by every key it claims (its
release names, the timm names of its releases and of timm's models, its transformers
`model_type`s), no two claim the same key, and the readers answer from them."""

import dataclasses
import re

import pytest

from vit_keras.weights import families, releases
from vit_keras.weights.checkpoints import huggingface, timm

pytestmark = pytest.mark.backend_independent


def test_each_record_is_found_by_its_release_names_and_model_types():
    for record in families.FAMILIES:
        for name in record.release_names:
            assert families.by_release(name) is record, (record.name, name)
        for model_type in record.model_types:
            assert families.by_model_type(model_type) is record, (record.name, model_type)


def test_no_two_records_share_a_name_a_release_or_a_model_type():
    for key in ("name", "release_names", "model_types"):
        claimed = [value for record in families.FAMILIES for value in (
            getattr(record, key) if key != "name" else (record.name,))]
        assert len(claimed) == len(set(claimed)), key


def test_every_release_belongs_to_exactly_the_family_that_claims_it():
    claimed = {name for record in families.FAMILIES for name in record.release_names}
    assert claimed == set(releases.RELEASE_NAMES)
    assert releases.PAPER_RELEASE_NAMES == families.VIT.release_names
    assert all(families.by_release(name) is not families.VIT
               for name in releases.FAMILY_RELEASE_NAMES)


@pytest.mark.parametrize("release", [r for r in releases.RELEASES if any(
    i.startswith("timm/") for i in (r.hf_hub_id or "", *r.other_hub_ids))],
    ids=lambda r: f"{r.variant}-{r.name}-{r.image_size}")
def test_the_timm_name_of_each_release_finds_the_releases_family(release):
    """`timm/vit_base_patch16_224.mae` is MAE's, `timm/eva02_base_patch14_224.mim_in22k`
    EVA-02's, an AugReg file the paper's ViT's: the timm key and the release key agree."""
    hub_id = next(i for i in (release.hf_hub_id or "", *release.other_hub_ids)
                  if i.startswith("timm/"))
    record = families.by_release(release.name)
    assert families.by_timm_name(hub_id[len("timm/"):]) is record
    said = timm.architecture_hints(hub_id[len("timm/"):])
    assert said.get("family") == (record.name if record.names_models else None)


def test_a_key_no_record_claims_finds_none_or_the_papers_vit():
    assert families.by_release("imagenet22k") is None
    assert families.by_model_type("bert") is None
    assert families.by_timm_name("vit_base_patch16_224") is families.VIT
    assert families.by_timm_name("resnet50.a1_in1k") is families.VIT
    assert "family" not in timm.architecture_hints("vit_base_patch16_224.augreg_in21k")


def test_eva02_clip_towers_are_eva02s_the_one_timm_key_two_patterns_match():
    timm_lib = pytest.importorskip("timm")
    names = set(timm_lib.list_models()) | set(timm_lib.list_pretrained())
    shared, found = {}, {record.name: 0 for record in families.FAMILIES}
    for name in names:
        matching = [record for record in families.FAMILIES
                    if record.timm_pattern and re.search(record.timm_pattern, name)]
        if len(matching) > 1:
            shared.setdefault(tuple(record.name for record in matching), []).append(name)
        found[families.by_timm_name(name).name] += 1
    # The first record that matches is the family: EVA-02's CLIP towers are EVA-02's.
    assert set(shared) == {("EVA02", "CLIP")}
    assert all(families.by_timm_name(name).name == "EVA02" for name in shared["EVA02", "CLIP"])
    assert all(found.values()), found  # each record is some timm name's family


def test_the_transformers_defaults_are_each_config_classs():
    """A `config.json` leaves out the fields at their config class's defaults: the record's must
    be transformers' own, for every `model_type` it claims."""
    transformers = pytest.importorskip("transformers")
    for record in families.FAMILIES:
        for model_type in record.model_types:
            config = transformers.AutoConfig.for_model(model_type)
            assert config.model_type == model_type
            assert {key: getattr(config, key) for key in record.transformers_defaults} == \
                record.transformers_defaults, model_type
            assert config.num_attention_heads == record.transformers_heads, model_type


def test_the_readers_answer_from_the_records():
    assert set(huggingface.FAMILIES) == set(families.model_types())
    for model_type in huggingface.FAMILIES:
        record = families.by_model_type(model_type)
        said = huggingface.hints({"model_type": model_type, "use_head": False})  # AIMv2's
        assert said.get("family") == (record.name if record.names_models else None)
        assert said["num_heads"] == record.transformers_heads
        theta = record.transformers_defaults.get("rope_theta")
        assert said.get("rope") == (record.rope if theta is None else dataclasses.replace(
            record.rope, temperature=theta))
    assert releases.FAMILY_NUMERICS == {
        name: families.by_release(name).numerics
        for name in releases.FAMILY_RELEASE_NAMES + releases.BIG_VISION_RELEASE_NAMES}
    for release in releases.RELEASES:
        record = families.by_release(release.name)
        assert release.normalization.name == record.normalization, release.spec
