"""What the model family knows: where a layer's tensors live, the family's own decoder layer and model front, up-front compatibility checks."""
