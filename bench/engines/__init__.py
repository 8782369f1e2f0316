"""What a worker gets from its engine: the admission latch under overload, a real engine against vLLM's runner."""
