#!/usr/bin/env bash
# Debian packages the GPU machine needs to build and run the Vulkan backend (it has the NVIDIA driver's Vulkan ICD
# but no loader, no headers, no shader compiler, and no network), downloaded here by name:
#   bash tools/vulkan-kit.sh      # then carry .gl and .vkdev to the GPU machine; tools/gpu-run.sh uses them
# .gl: the loader and libglvnd, unpacked into / there (as the device notes say); .vkdev: glslc, its libshaderc,
# the Vulkan and SPIR-V headers and the loader again, unpacked into /tmp/vkroot there (not /: they could break it).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gl .vkdev
arch=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64)
(cd .gl && apt-get "${arch[@]}" download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
(cd .vkdev && apt-get "${arch[@]}" download glslc libshaderc1 libvulkan-dev libvulkan1 spirv-headers)
grep -qx '/.gl/' .git/info/exclude 2>/dev/null || printf '/.gl/\n/.vkdev/\n' >> .git/info/exclude
