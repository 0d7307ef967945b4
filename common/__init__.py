"""What every process shares that is not a wire format."""
