"""Ray Serve application: OpenAI ingress, engine replica deployment, controller loop, metrics."""
