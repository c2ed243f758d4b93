"""The Keras objects of training that a saved model may carry, in the core so that `import
vit_keras` registers them: the warm-up schedule (`schedules.py`), the layer-decay optimizers
(`layer_decay.py`), masked patch prediction's layers and model (`masked_patch_prediction.py`), and
few-shot evaluation (`fewshot.py`). Runs, data and apps are `vit_keras.tools`'."""
