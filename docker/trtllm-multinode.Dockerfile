# syntax=docker/dockerfile:1
# A TensorRT-LLM deployment across nodes (`specbuild deploy --backend trtllm --kubernetes --gpus-per-node N` when
# tp x pp > N): the release container plus kubectl, which the LeaderWorkerSet's leader uses to start OpenMPI's daemon
# in the worker pods (mpirun -mca plm_rsh_agent kubessh, as upstream's LWS example for Triton + TensorRT-LLM does).
# Pick the release container of your TensorRT-LLM version (docs/deploying-on-gpus.md, version matrix):
#
#   docker build -f docker/trtllm-multinode.Dockerfile \
#     --build-arg TRITON_TRTLLM_IMAGE=nvcr.io/nvidia/tritonserver:25.09-trtllm-python-py3 -t REGISTRY/trtllm-mn:25.09 .
#
# Health: the manifests' probes (/v2/health/{live,ready} on the leader); no HEALTHCHECK (Kubernetes ignores it).
ARG TRITON_TRTLLM_IMAGE=nvcr.io/nvidia/tritonserver:25.09-trtllm-python-py3
FROM registry.k8s.io/kubectl:v1.34.1 AS kubectl

FROM ${TRITON_TRTLLM_IMAGE}
COPY --from=kubectl /bin/kubectl /usr/local/bin/kubectl
# NGC's tritonserver images carry the user triton-server (uid 1000), which the manifests run as.
USER 1000:1000
