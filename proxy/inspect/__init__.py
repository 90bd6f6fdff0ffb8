"""Stream inspectors: stages that read every SSE chunk of a response as it passes."""
