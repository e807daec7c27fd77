"""Object detection: boxes and their conventions, COCO and YOLO folders, a synthetic set, a
``Dataset`` in torchvision's detection convention, augmentations that move boxes with pixels
and COCO's mAP (pycocotools); ``task`` is the detection :class:`~hpc_core.tasks.base.Task`
(a torchvision detector's losses and detections) and ``sources`` builds its data sets from
a config; ``synthetic_config`` holds the synthetic set's settings, torch-free, for the config.

Convention throughout: boxes are ``xyxy`` in absolute pixels, float32, ``x2 > x1`` and
``y2 > y1``; labels are contiguous class indices ``0 .. K-1`` into the set's ``class_names``
(a COCO file's category ids and a YOLO file's class numbers are mapped on load). On their way
to a torchvision detector labels are shifted by one (``sources.LABEL_OFFSET``): its label 0 is
the background.
"""
