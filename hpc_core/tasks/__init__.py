"""What the model is trained to do: one sub-package per task.

A task will own everything that differs between classifying an image and finding objects in
it, so that the one training loop (``hpc_core.trainer``) stays one loop:

- its data: loaders for the formats users bring, a ``Dataset`` and the ``collate`` that
  batches it (detection batches are lists: images differ in size and box counts);
- its loss, and how a batch of targets reaches the model;
- its metrics and its evaluation over a validation set;
- the one scalar the gates compare (top-1 accuracy for classification, mAP@0.5:0.95 for
  detection);
- what a served response carries (a class and its score; boxes, labels and scores).

``detection`` holds the detection task's data and metric today; ``classification`` will take
what ``hpc_core.data`` and the trainer's accuracy hold now, and ``segmentation`` (masks in
COCO's polygon / RLE forms, mean IoU) would go beside them as ``hpc_core.tasks.segmentation``.
"""
