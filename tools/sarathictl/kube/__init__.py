"""`sarathictl status --kubernetes`: a Helm release's pipelines found through the Kubernetes API,
each controller's Status joined with its pods. The `kubernetes` package is imported in connect.py
and forward.py only, when the command runs."""
