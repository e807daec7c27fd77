"""Models from the ecosystem: torchvision classifiers and detectors, timm backbones.

Built by name from a training config's ``model`` section (``torchvision/resnet18``,
``timm/mobilenetv3_small_100``), with pretrained weights from a local file pinned by sha256
(``model.weights``); nothing is ever downloaded at run time. Every module here imports
torchvision through :func:`hpc_core.vision.torchvision_ops.import_torchvision`.
"""
