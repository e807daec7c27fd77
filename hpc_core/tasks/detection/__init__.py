"""Object detection: boxes and their conventions, COCO and YOLO folders, a synthetic set, a
``Dataset`` in torchvision's detection convention, augmentations that move boxes with pixels
and COCO's mAP (pycocotools).

Convention throughout: boxes are ``xyxy`` in absolute pixels, float32, ``x2 > x1`` and
``y2 > y1``; labels are contiguous class indices ``0 .. K-1`` into the set's ``class_names``
(a COCO file's category ids and a YOLO file's class numbers are mapped on load).
"""
