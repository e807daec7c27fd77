"""The model registry protocol, shared by upstream, devices and the fleet; torch-free.

Manifest schema and names (``manifest``, ``names``), strict JSON (``jsonsafe``), safetensors
headers and pickle refusal (``safetensors_io``), chunk layout (``chunks``), Ed25519 signing
and scoped trusted keys (``signing``), stores behind one ``open_store`` (``stores``), network
behaviour and the one retry loop (``transfer``), a client's token bound to one registry
(``credentials``), references (``refs``), and the three operations: ``publish``, ``pull``
(verify + fetch chunks) and ``upload`` (device -> cloud). ``serve`` is the HTTP registry (its
application ``serve_app``), with its principals (``principals``) and per-object write rules
(``write_rules``). What every other package shares from here: the bounded HTTP server
(``http_server``: ASGI on uvicorn, every connection, head, body and write under a deadline;
``http_request``: what an application on it uses to take a body), on which both
``registry.serve`` and ``agentctl serve`` run, crash-safe file writes (``atomic``), the model
spec (``model_config``) and strict models with their error lines (``validation``). It imports
no other package of this repository.
Every error is a ``registry.errors.RegistryError`` carrying its exit code.
"""
