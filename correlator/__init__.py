"""The streaming correlator: attributes worker stalls and GPU idle time to their causes."""
