"""The runtime's tests' shared emulation: device buffers whose host writes land late, as CUDA's may."""

import numpy as np
import onnxruntime as ort
import pytest

from kvserve.runtime import pool as pool_module


class LateUploads:
    """Device values emulated on the CPU provider: a write into one (OrtValue.update_inplace) is still on its way when the
    call returns, as a cudaMemcpy from pageable memory may be under CUDA, and lands only at the CUDA runtime's wait
    (DeviceCopies.wait, which runtime.pool.settle_uploads calls)."""

    def __init__(self, host_value):
        self.host_value = host_value  # ONNX Runtime's own ortvalue_from_numpy
        self.on_the_way: list[tuple[ort.OrtValue, np.ndarray]] = []
        self.waits = 0
        uploads = self

        class DeviceValue(ort.OrtValue):
            def update_inplace(self, data) -> None:
                uploads.on_the_way.append((self, np.array(data)))

        self.device_value_type = DeviceValue

    def value(self, array) -> ort.OrtValue:
        """A device value holding a copy of array: what the host buffer held when the value was made."""
        memory = np.array(array)
        return self.device_value_type(self.host_value(memory)._ortvalue, memory)

    def wait(self) -> None:
        self.waits += 1
        for value, data in self.on_the_way:
            ort.OrtValue.update_inplace(value, data)
        self.on_the_way.clear()


@pytest.fixture
def late_uploads(monkeypatch) -> LateUploads:
    """Values made for a device other than the CPU are LateUploads' values, and the CUDA runtime's wait lands them."""
    uploads = LateUploads(ort.OrtValue.ortvalue_from_numpy)

    def made_for(array, device_type="cpu", device_id=0, *rest):
        if device_type == "cpu":
            return uploads.host_value(array, device_type, device_id, *rest)
        return uploads.value(array)

    monkeypatch.setattr(ort.OrtValue, "ortvalue_from_numpy", staticmethod(made_for))
    monkeypatch.setattr(pool_module, "device_copies", lambda: uploads)
    return uploads
