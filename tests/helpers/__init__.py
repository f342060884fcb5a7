"""Code the tests share: process harnesses, worker functions, launcher and HF helpers. Test modules
import from here, never from one another."""
