"""What a trained ViT computes inside: the analysis of the paper's Section 4.5 (`analysis.py`:
attention rollout and distance, position-embedding similarity, filter components) and
intermediate features (`features.py`)."""
