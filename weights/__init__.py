"""Policy weights from the learner to the actors: every transport (objstore, shared_dir, cuda_ipc,
nccl) behind one interface (weights.common.Transport), found by kind in weights.registry and
configured by [weights] (weights.config). The announcement itself is a wire type in
protocol.messages (WeightVersion); this package owns how the bytes travel.
"""
