"""Every public name stays importable where the API page documents it, and where it documented
it before the core moved into sub-packages (a user's imports keep working)."""

import importlib
import os
import re

import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.backend_independent

# The `::: name` entries of docs/api.md at 21b95ce, before issue 43 reorganised the core.
DOCUMENTED_BEFORE = """
vit_keras.build_model vit_keras.build_model_from_checkpoint vit_keras.with_dynamic_image_size
vit_keras.normalization vit_keras.list_weights vit_keras.Release vit_keras.class_names
vit_keras.pretrained.release_of vit_keras.pretrained.resolve_weights
vit_keras.pretrained.read_release vit_keras.releases.find_release
vit_keras.releases.FAMILY_NUMERICS vit_keras.download vit_keras.download_http
vit_keras.release_files vit_keras.errors vit_keras.VARIANTS vit_keras.ViTConfig
vit_keras.get_config vit_keras.load_pretrained vit_keras.check_keras_file
vit_keras.keras_files.KerasFileError vit_keras.save_npz vit_keras.resample_position_embeddings
vit_keras.resample_patch_embedding vit_keras.PatchEmbedding vit_keras.ClassToken
vit_keras.AddPositionEmbs vit_keras.MultiHeadDotProductAttention vit_keras.MlpBlock
vit_keras.TransformerBlock vit_keras.TokenPooling vit_keras.DistillationToken
vit_keras.RegisterTokens vit_keras.LayerScale vit_keras.HeadsProjection vit_keras.MAPHead
vit_keras.StdConv2D vit_keras.ResidualUnit vit_keras.ResNetStage vit_keras.ResNetStem
vit_keras.attention_scores vit_keras.build_feature_extractor vit_keras.intermediate_features
vit_keras.attention_rollout vit_keras.mean_attention_distance
vit_keras.position_embedding_similarity vit_keras.embedding_filter_components
vit_keras.token_grid vit_keras.token_size_pixels vit_keras.masked_patch_prediction
vit_keras.fewshot vit_keras.keep_freed_host_memory vit_keras.attention vit_keras.kernels
vit_keras.xla_cpu vit_keras.interpolation_ops vit_keras.geometry vit_keras.tools
vit_keras.tools.data vit_keras.tools.recipes vit_keras.schedules.WarmupSchedule
vit_keras.layer_decay vit_keras.tools.ema vit_keras.tools.callbacks
vit_keras.tools.distribution vit_keras.tools.training vit_keras.tools.objectives
vit_keras.tools.evaluation vit_keras.tools.memory vit_keras.tools.config_flags
vit_keras.tools.run_folder vit_keras.tools.export vit_keras.tools.plots
""".split()


def _documented_now():
    with open(os.path.join(REPO_ROOT, "docs", "api.md")) as f:
        return re.findall(r"^::: ([\w.]+)", f.read(), flags=re.M)


def _resolve(dotted):
    """The module or attribute `dotted` names, imported as a user would."""
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError:
        parent, _, name = dotted.rpartition(".")
        return getattr(importlib.import_module(parent), name)


@pytest.mark.parametrize("name", sorted(set(DOCUMENTED_BEFORE) | set(_documented_now())))
def test_a_documented_name_imports(name):
    assert _resolve(name) is not None


def test_the_api_page_documents_the_model_and_its_slots():
    documented = set(_documented_now())
    assert {"vit_keras.ViT", "vit_keras.model.mlp", "vit_keras.model.norms",
            "vit_keras.model.position_embeddings", "vit_keras.model.heads"} <= documented


def test_an_old_module_path_is_the_new_module_behind_a_dated_warning():
    import datetime  # pylint: disable=import-outside-toplevel

    import vit_keras  # pylint: disable=import-outside-toplevel
    from vit_keras import _moved  # pylint: disable=import-outside-toplevel
    from vit_keras.weights.checkpoints import timm  # pylint: disable=import-outside-toplevel

    with pytest.warns(DeprecationWarning, match=r"vit_keras\.layers moved to "
                      rf"vit_keras\.model\.layers.*{_moved.REMOVAL}"):
        assert vit_keras.layers.TransformerBlock is vit_keras.TransformerBlock
    old = importlib.import_module("vit_keras.checkpoints.timm")
    with pytest.warns(DeprecationWarning, match=r"vit_keras\.weights\.checkpoints\.timm"):
        assert old.matches is timm.matches
    matches = timm.matches
    try:
        with pytest.warns(DeprecationWarning):  # a patch through the old path reaches the module
            old.matches = None
        assert timm.matches is None
    finally:
        timm.matches = matches
    assert datetime.date.fromisoformat(_moved.REMOVAL) > datetime.date(2026, 11, 28)


def test_an_old_tools_path_is_the_new_module_behind_a_dated_warning():
    from vit_keras.tools.runs import training  # pylint: disable=import-outside-toplevel

    old = importlib.import_module("vit_keras.tools.training")
    with pytest.warns(DeprecationWarning, match=r"vit_keras\.tools\.training moved to "
                      r"vit_keras\.tools\.runs\.training"):
        assert old.run is training.run
