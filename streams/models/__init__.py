"""The shipped OOM predictor artifact (oom_lstm.pt + oom_lstm.json); see README.md here."""
