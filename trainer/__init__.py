"""Hybrid data x spatial parallel 3D CNN trainer fed by ``DataStoreLoader`` (trainer issue)."""
