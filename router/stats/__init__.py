"""What the router measures: windowed per-model statistics (`windows`), per-request records by
revision and endpoint for canary analysis (`request_log`), and the Prometheus metrics (`metrics`).
"""
