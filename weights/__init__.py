"""Policy weights from the learner to the actors, both ends: the learner's one publish call
(weights.publish.Weights), the actor's one follow loop (weights.follow.WeightFollower), the payload
kinds with their publish and load halves (weights.payloads: full, delta, packed delta, GPU buffer,
adapter, adapter in GPU memory), the vLLM workers' side of a load (weights.worker), and every
transport (objstore, shared_dir, cuda_ipc, nccl) behind one interface (weights.common.Transport),
found by kind in weights.registry and configured by [weights] (weights.config). The announcement
itself is a wire type in protocol.messages (WeightVersion).
"""
