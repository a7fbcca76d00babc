from sgl_dspark.srt.layers.moe.experts import RoutedExperts, SharedExpert, SparseMoE
from sgl_dspark.srt.layers.moe.router import Router

__all__ = ["Router", "RoutedExperts", "SharedExpert", "SparseMoE"]
