"""Weights in and out of a `ViT`: the published releases and their cache (`releases.py`,
`download.py`, `download_http.py`, `release_files.py`), one record per family of checkpoints
(`families.py`), the checkpoint formats and the one name map (`checkpoints/`), `build_model`
(`pretrained.py`, the facade that joins the model and the weights), resampling for a new
resolution or patch size (`posemb.py`, `patch_resize.py`), class names (`labels.py`), and the
check of a user's `.keras` file (`keras_files.py`)."""
