"""Recurrent-layer tree verification and factor commit (Gated DeltaNet, Mamba2/SSD, short conv)."""
