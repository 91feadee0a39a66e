"""What a request asks for: sampling and structured-output parameters (torch-free)."""
