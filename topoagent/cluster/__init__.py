"""The cluster side: the kube-scheduler extender and the kubelet device plugin.  They speak
to agents only over HTTP and through the documents; nothing here imports the agent's internals."""
