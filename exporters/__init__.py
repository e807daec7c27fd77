"""Exporters: prune, quantize and export trained models, gated on the exported artefact.

Used by the edge agent and callable alone (``python -m exporters``). The modules, in the
order a job uses them: ``prune`` / ``channel_prune`` -> ``recovery`` -> ``onnx_export`` ->
``calibration`` + ``quantize`` (checked by ``qdq_check``) -> ``tensorrt_build`` ->
``gates``, with ``qat`` as a fallback step; a detector's core, NMS tail and padded outputs
live in ``detection/`` (the core is what INT8 quantizes); ``job`` holds the job's models
(torch-free: the daemon and agentctl's parsers load them), ``pipeline`` runs the whole job
with its fallback chain, ``report`` writes what happened, ``cli`` parses the command line.
"""
