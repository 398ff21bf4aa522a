"""The app ``scripts/wheel_smoke.sh`` copies into a new ``startproject`` to drive durable."""
