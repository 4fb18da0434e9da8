# .ci/portable/_aarch64_sysroot.sh: what python_aarch64.sh and wheel_aarch64.sh both need (sourced,
# never run; as root on a Debian/Ubuntu x86-64 host).
# aarch64_sysroot WORK: the cross toolchain and qemu-user from apt; Debian's arm64 CPython 3.11
# and its libraries unpacked (not installed) into WORK/root (skipped when already there); PyPI's
# aarch64 wheels of the test dependencies in WORK/wheels; qemu-aarch64 registered with
# binfmt_misc, so that an aarch64 executable a test starts (sys.executable) runs too. Sets
# QEMU_LD_PREFIX (exported) and A64PY, the arm64 interpreter.
aarch64_sysroot() {
  local work=$1 d
  mkdir -p "$work"/{debs,root,wheels}
  dpkg --add-architecture arm64
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++-aarch64-linux-gnu qemu-user >/dev/null
  if [[ ! -e "$work/root/.unpacked" ]]; then
    (cd "$work/debs" && apt-get download -q \
      python3.11-minimal:arm64 libpython3.11-minimal:arm64 libpython3.11-stdlib:arm64 \
      libpython3.11-dev:arm64 libc6:arm64 libstdc++6:arm64 libgcc-s1:arm64 zlib1g:arm64 \
      libexpat1:arm64 libffi8:arm64 libssl3:arm64 libbz2-1.0:arm64 liblzma5:arm64 \
      libsqlite3-0:arm64 libuuid1:arm64 libncursesw6:arm64 libtinfo6:arm64 libreadline8:arm64 \
      libdb5.3:arm64 libgdbm6:arm64 libcrypt1:arm64 libnsl2:arm64 libtirpc3:arm64 \
      libgssapi-krb5-2:arm64 libkrb5-3:arm64 libk5crypto3:arm64 libcom-err2:arm64 \
      libkrb5support0:arm64 libkeyutils1:arm64 >/dev/null)
    for d in "$work"/debs/*.deb; do dpkg -x "$d" "$work/root"; done
    touch "$work/root/.unpacked"
  fi
  export QEMU_LD_PREFIX=$work/root
  A64PY=$work/root/usr/bin/python3.11

  python3 -m pip download -q -d "$work/wheels" --only-binary=:all: --python-version 3.11 --implementation cp \
    --platform manylinux_2_28_aarch64 --platform manylinux_2_17_aarch64 --platform manylinux2014_aarch64 \
    numpy ml_dtypes pytest hypothesis safetensors

  [ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
  [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || cat /usr/lib/binfmt.d/qemu-aarch64.conf > /proc/sys/fs/binfmt_misc/register
}
