"""Browser compute: the gradient graph a tab runs for a campaign's model, and the gate that checks it against PyTorch.

Plain modules, importable without Django settings (the tests and ``python -m
crowdtrain.browser.report`` use them alone). Nothing is imported here: the
exporter and onnxruntime take seconds to load, and only the code that builds or
checks a graph needs them.
"""
