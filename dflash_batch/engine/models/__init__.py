"""What the engine loads, and how: the target and drafter models, their loaders, the registry of
known pairs and the embedded default pair. Imports the ops below it, never the decoding loop."""
