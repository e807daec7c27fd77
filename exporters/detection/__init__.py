"""A detector's export: its exportable core (``core``, torch), the decoding and NMS tail
written as ONNX nodes (``tail``) and the names and shapes of the graph's outputs
(``outputs``, numpy only: the device runtime and the model server read them without torch).
This package's import loads nothing."""
