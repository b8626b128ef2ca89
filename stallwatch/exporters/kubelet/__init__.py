"""The kubelet's pod-resources API (api.proto) and its generated messages (`make protos`)."""
