"""nnsight 0.8 dialect on TorchLens (placeholder until the shim lands)."""
