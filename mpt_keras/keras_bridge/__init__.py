"""How the toolkit attaches to a Keras model: its layers' paths, their calls, the global step.

layer_paths.py        the path of every layer, and the forms a rule's path is tried in
layer_calls.py        layers' `call` wrapped for the length of a block
callbacks.py          callbacks that know the global train step
traced_functions.py   a model's traced train, test and predict functions, made again
                      after its layers change
task_models.py        Keras' own fit and evaluate for keras_hub task models
"""
